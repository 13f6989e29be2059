"""Triton kernels with fewer queries than keys (decoding with a KV cache, chunked prefill): each document's
queries are its last positions. CPU interpreter vs the float64 reference: o, dq, dk, dv and dsinks."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before that import

import pytest  # noqa: E402
import torch  # noqa: E402

from gptoss_kernels import sink_attention, sink_attention_ref  # noqa: E402
from gptoss_kernels.triton import launchers, sink_attention_triton  # noqa: E402

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not (launchers.INTERPRETED or torch.cuda.is_available()),
        reason="no CUDA, and gptoss_kernels.triton was imported before TRITON_INTERPRET=1 was set",
    ),
]
NAMES = ("o", "dq", "dk", "dv", "dsinks")


@pytest.fixture(autouse=True)
def _nan_filled_outputs(monkeypatch):
    monkeypatch.setattr(launchers, "FILL_OUTPUTS_WITH_NAN", True)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


CASES = {  # (query lengths, key lengths, Hq, Hkv, head_dim, window, blocks)
    "decode-1-of-40-and-1-of-7": ((1, 1), (40, 7), 4, 2, 16, None, (16, 16)),
    "decode-window9-gqa4-d24": ((1, 1, 1), (33, 5, 70), 4, 1, 24, 9, (16, 16)),
    "chunked-prefill-21-of-50-win13": ((21, 9), (50, 9), 4, 2, 32, 13, (16, 32)),
    "no-query-doc-and-chunk": ((0, 17), (12, 60), 2, 2, 16, 20, (32, 16)),
}


def _run(fn, leaves, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fewer_queries_than_keys_matches_float64_reference(case):
    lens_q, lens_k, hq, hkv, dim, window, blocks = case
    q = torch.randn(sum(lens_q), hq, dim, dtype=torch.float64)
    k, v = (torch.randn(sum(lens_k), hkv, dim, dtype=torch.float64) for _ in range(2))
    sinks = torch.rand(hq, dtype=torch.float64) * 3 - 1
    grad_out = torch.randn_like(q)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)

    def reference(q, k, v, s):  # one batched (Tq <= Tk) problem per document
        pieces = []
        for (qa, qb), (ka, kb) in zip(
            zip(cu_q[:-1].tolist(), cu_q[1:].tolist()), zip(cu_k[:-1].tolist(), cu_k[1:].tolist())
        ):
            pieces.append(sink_attention_ref(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], s, window=window)[0])
        return torch.cat(pieces)

    def triton(q, k, v, s):
        return sink_attention_triton(
            q,
            k,
            v,
            s,
            cu_seqlens=cu_q,
            max_seqlen=max(lens_q),
            window=window,
            block_sizes=blocks,
            cu_seqlens_k=cu_k,
            max_seqlen_k=max(lens_k),
        )

    want = _run(reference, (q, k, v, sinks), grad_out)
    got = _run(triton, [t.float() for t in (q, k, v)] + [sinks.float()], grad_out.float())
    for name, g, w in zip(NAMES, got, want):
        assert not torch.isnan(g).any(), f"{name}: NaN (an element the kernel never wrote?)"
        diff = (g.double() - w).abs().max().item()
        assert diff <= 1e-5 * max(w.abs().max().item(), 1.0), f"{name}: max|diff|={diff:.3e}"


def test_batched_decode_through_the_public_entry():
    """``sink_attention(q [B, Tq], k [B, Tk], backend="triton")`` flattens to per-row documents."""
    q = torch.randn(2, 3, 4, 16)
    k, v = torch.randn(2, 19, 2, 16), torch.randn(2, 19, 2, 16)
    sinks = torch.randn(4)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    out = sink_attention(*leaves, window=5, backend="triton")
    got = [out, *torch.autograd.grad(out.sum(), leaves)]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = sink_attention_ref(*leaves64, window=5)
    for name, g, w in zip(NAMES, got, [ref, *torch.autograd.grad(ref.sum(), leaves64)]):
        diff = (g.double() - w).abs().max().item()
        assert diff <= 1e-5 * max(w.abs().max().item(), 1.0), f"{name}: max|diff|={diff:.3e}"
