"""Full causal layers on CPU: torch's fused flash kernel + sink rescale (``fused_cpu.py``) vs the float64
reference, o and every gradient (dsinks included), and the dispatch that sends only exact cases there."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gptoss_kernels import fused_cpu, sink_attention, sink_attention_ref

F64 = torch.float64
NAMES = ("o", "dq", "dk", "dv", "dsinks")
CASES = {  # batch, T, Hq, Hkv, head_dim, sink value (None = random)
    "b2-t113-h8kv2-d64": (2, 113, 8, 2, 64, None),
    "b1-t300-h64kv8-d64-gpt-oss-heads": (1, 300, 64, 8, 64, None),
    "b3-t37-h4kv4-d24": (3, 37, 4, 4, 24, None),
    "b1-t1-h2kv1-d8": (1, 1, 2, 1, 8, None),
    "sink30-only-sink": (1, 40, 4, 2, 16, 30.0),
    "no-sink": (2, 45, 4, 2, 16, float("-inf")),
}


def _leaves(batch, seqlen, hq, hkv, dim, sink, dtype):
    q = torch.randn(batch, seqlen, hq, dim, dtype=F64)
    k, v = (torch.randn(batch, seqlen, hkv, dim, dtype=F64) for _ in range(2))
    sinks = torch.rand(hq, dtype=F64) * 4 - 1 if sink is None else torch.full((hq,), sink, dtype=F64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, sinks)]


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fused_cpu_matches_float64_reference(case, dtype):
    leaves = _leaves(*case, dtype)
    grad_out = torch.randn(leaves[0].shape, dtype=dtype)
    out = fused_cpu.sink_attention_fused_cpu(*leaves)
    got = [out, *torch.autograd.grad(out, leaves, grad_out)]
    leaves64 = [t.detach().to(F64).requires_grad_() for t in leaves]
    ref = sink_attention_ref(*leaves64)
    want = [ref, *torch.autograd.grad(ref, leaves64, grad_out.to(F64))]
    rel = 1e-5 if dtype == torch.float32 else 1e-12
    for name, g, w in zip(NAMES, got, want):
        assert torch.isfinite(g).all(), f"{name} has non-finite entries"
        diff = (g.to(F64) - w).abs().max().item()
        assert diff <= rel * max(w.abs().max().item(), 1.0), f"{name}: max|diff|={diff:.3e}"


@pytest.mark.parametrize(
    "kwargs, fused",
    [
        (dict(), True),
        (dict(window=500), True),  # at least as long as the sequence: the same attention
        (dict(window=7), False),
        (dict(key_mask=torch.ones(1, 20, dtype=torch.bool)), False),
        (dict(backend="chunked"), False),  # forcing the tile path keeps it
    ],
    ids=["full", "window-ge-T", "window", "key-mask", "forced-chunked"],
)
def test_auto_takes_the_fused_path_only_for_full_causal(monkeypatch, kwargs, fused):
    calls = []
    original = fused_cpu.FusedCpuSinkAttention.apply
    monkeypatch.setattr(fused_cpu.FusedCpuSinkAttention, "apply", lambda *a: calls.append(1) or original(*a))
    q, k, v = torch.randn(1, 20, 4, 16), torch.randn(1, 20, 2, 16), torch.randn(1, 20, 2, 16)
    out = sink_attention(q, k, v, torch.randn(4), **kwargs)
    assert bool(calls) == fused
    assert torch.isfinite(out).all()
    assert fused_cpu.fused_cpu_supports(q.bfloat16(), k, None, None, None) is not None, "16-bit stays chunked"


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel, *(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))])
        return out


def test_nothing_larger_than_q_is_allocated():
    """Forward + backward at T=1024: every tensor the path creates is at most q's size (no T x T)."""
    leaves = _leaves(1, 1024, 8, 2, 16, None, torch.float32)
    with _LargestTensor() as largest:
        sink_attention(*leaves).sum().backward()
    assert largest.numel <= leaves[0].numel(), largest.numel
