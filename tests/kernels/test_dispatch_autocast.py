"""Every backend of ``sink_attention`` under ``torch.autocast`` on the CPU (bf16 and fp16), padded, packed and
decoding layouts: output and every gradient (dq, dk, dv, dsinks) against the float64 reference.

Autocast runs attention in its low dtype (q, k, v are cast, as for torch SDPA), so the yardstick is what
transformers' GPT-OSS eager attention gives under the same autocast, on the same fp32 inputs::

    |backend - ref64| <= 2 |eager_autocast - ref64| + 1e-3 * max(|ref64|, 1)

Eager's own error is that of matmuls in the low dtype; the backends cast q, k, v once and accumulate in
fp32, so they sit well inside it. The Triton kernel (interpreted) stores ``o`` in the low dtype and forms its
``D = rowsum(dO * o)`` from that, as every FlashAttention backward does, so its dsinks carries ``o``'s
rounding: its yardstick also admits the dsinks formula fed with the low-precision ``o`` (as in
``test_triton_attention.py``).
"""

import os
from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from gptoss_kernels import sink_attention, sink_attention_chunked, sink_attention_ref

NAMES = ("o", "dq", "dk", "dv", "dsinks")
LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HQ, HKV, DIM = 4, 2, 16
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _key_mask(kind, batch, tk):
    mask = torch.ones(batch, tk, dtype=torch.bool)
    if kind == "left":
        mask[1, :5] = False
    elif kind == "holes":
        mask[0, 3:6] = False
        mask[1, 2::4] = False
    return mask


# id -> (batch, tq, tk, window, key mask kind or None, packed document lengths or None)
LAYOUTS = {
    "padded-holes-win5": (2, 19, 19, 5, "holes", None),
    "padded-left-full": (2, 19, 19, None, "left", None),
    "decode-3-of-17-left-pad-win6": (2, 3, 17, 6, "left", None),
    "batched-full-no-mask": (2, 19, 19, None, None, None),
    "packed-varlen-win4": (1, 27, 27, 4, None, (9, 1, 17)),
}


def _allowed(batch, tq, tk, window, key_mask, lengths):
    """Bool ``[B, Tq, Tk]``: causal (queries are the last Tq positions), window, padding keys, documents."""
    q_pos = torch.arange(tk - tq, tk)[:, None]
    k_pos = torch.arange(tk)[None, :]
    allowed = (k_pos <= q_pos).expand(batch, tq, tk).clone()
    if window is not None:
        allowed &= k_pos > q_pos - window
    if key_mask is not None:
        allowed &= key_mask[:, None, :]
    if lengths is not None:
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        allowed &= doc[None, :, None] == doc[None, None, :]
    return allowed


def _inputs(layout):
    batch, tq, tk, window, mask_kind, lengths = layout
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, tq, HQ, DIM, generator=gen)
    k, v = (torch.randn(batch, tk, HKV, DIM, generator=gen) for _ in range(2))
    sinks = torch.rand(HQ, generator=gen) * 4 - 1
    do = torch.randn(batch, tq, HQ, DIM, generator=gen)
    key_mask = None if mask_kind is None else _key_mask(mask_kind, batch, tk)
    kwargs = dict(window=window, key_mask=key_mask)
    if lengths is not None:  # the packed layout: [total, H, D] and cu_seqlens
        q, k, v, do = (t[0] for t in (q, k, v, do))
        kwargs = dict(window=window, cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0)], dtype=torch.int32))
    return (q, k, v, sinks), do, kwargs, _allowed(batch, tq, tk, window, key_mask, lengths)


def _grads(fn, leaves, do):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, do.to(out.dtype))]


def _eager(q, k, v, sinks, allowed):
    """transformers' GPT-OSS eager attention on ``[B, T, H, D]`` (packed inputs as one row)."""
    packed = q.dim() == 3
    if packed:
        q, k, v = (t[None] for t in (q, k, v))
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=HQ // HKV, training=False)
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[:, None]
    out, _ = eager_attention_forward(module, *(t.transpose(1, 2) for t in (q, k, v)), additive, scaling=DIM**-0.5)
    return out[0] if packed else out


def _dsinks_from_output(leaves, kwargs, do, out):
    """``-sum_i exp(sink - lse_i) rowsum(dO_i * o_i)`` with the float64 lse and a given ``o`` (per head)."""
    _, lse = sink_attention_ref(*(t.double() for t in leaves), **kwargs, return_lse=True)
    delta = (do.double() * out.double()).sum(-1)
    return -(torch.exp(leaves[3].double() - lse) * delta).reshape(-1, HQ).sum(0)


def _check(got, leaves, do, kwargs, allowed, low, check_dsinks_formula=False):
    ref = _grads(lambda *t: sink_attention_ref(*t, **kwargs), [t.double() for t in leaves], do.double())
    with torch.autocast("cpu", dtype=low):
        eager = _grads(lambda *t: _eager(*t, allowed), leaves, do)
    assert got[0].dtype == low, f"o comes back in the autocast dtype, got {got[0].dtype}"
    assert [t.dtype for t in got[1:]] == [torch.float32] * 4, "gradients come back in the leaves' dtype"
    eager_err = [(e.double() - r).abs().max().item() for e, r in zip(eager, ref)]
    if check_dsinks_formula:
        formula = _dsinks_from_output(leaves, kwargs, do, got[0])
        eager_err[4] = max(eager_err[4], (formula - ref[4]).abs().max().item())
    for name, actual, err, expected in zip(NAMES, got, eager_err, ref):
        diff = (actual.double() - expected).abs()
        tol = 2 * err + 1e-3 * max(expected.abs().max().item(), 1.0)
        assert not torch.isnan(actual).any(), f"{name}: NaN"
        assert diff.max() <= tol, f"{name}: max|diff| {diff.max():.3e} (mean {diff.mean():.3e}) > tol {tol:.3e}"


@pytest.mark.parametrize("low", LOW_DTYPES.values(), ids=LOW_DTYPES.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("backend", ["auto", "chunked", "reference"])
def test_cpu_backends_under_autocast(backend, layout, low):
    leaves, do, kwargs, allowed = _inputs(layout)
    with torch.autocast("cpu", dtype=low):
        got = _grads(lambda *t: sink_attention(*t, backend=backend, **kwargs), leaves, do)
    _check(got, leaves, do, kwargs, allowed, low)


@pytest.mark.parametrize("low", LOW_DTYPES.values(), ids=LOW_DTYPES.keys())
def test_chunked_entry_and_backward_inside_autocast(low):
    """The chunked entry point itself, with ``.backward()`` also called inside the autocast region (autograd
    runs a backward under the autocast state of that call)."""
    leaves, do, kwargs, allowed = _inputs(LAYOUTS["padded-holes-win5"])
    fresh = [t.detach().clone().requires_grad_() for t in leaves]
    with torch.autocast("cpu", dtype=low):
        out = sink_attention_chunked(*fresh, **kwargs)
        out.backward(do.to(out.dtype))
    _check([out.detach(), *(t.grad for t in fresh)], leaves, do, kwargs, allowed, low)


def test_float64_is_left_alone_by_autocast():
    """Autocast casts no float64 tensor: the fused CPU path (full causal fp64) stays reference-exact."""
    leaves, do, kwargs, _ = _inputs(LAYOUTS["batched-full-no-mask"])
    leaves64 = [t.double() for t in leaves]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(lambda *t: sink_attention(*t, **kwargs), leaves64, do.double())
    want = _grads(lambda *t: sink_attention_ref(*t, **kwargs), leaves64, do.double())
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == torch.float64 and (g - w).abs().max().item() <= 1e-10, name


TRITON_LAYOUTS = {name: LAYOUTS[name] for name in ("batched-full-no-mask", "packed-varlen-win4")}


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 before triton is imported")
@pytest.mark.parametrize("low", LOW_DTYPES.values(), ids=LOW_DTYPES.keys())
@pytest.mark.parametrize("layout", TRITON_LAYOUTS.values(), ids=TRITON_LAYOUTS.keys())
def test_triton_backend_under_autocast(layout, low):
    pytest.importorskip("triton")
    leaves, do, kwargs, allowed = _inputs(layout)
    with torch.autocast("cpu", dtype=low):
        got = _grads(lambda *t: sink_attention(*t, backend="triton", **kwargs), leaves, do)
    _check(got, leaves, do, kwargs, allowed, low, check_dsinks_formula=True)


def test_mixed_input_dtypes_are_one_dtype_under_autocast():
    """fp32 q with bf16 k/v (what a model hands over when RoPE promotes only q) is one dtype under autocast;
    outside autocast it stays an error that names the dtypes."""
    leaves, _, kwargs, _ = _inputs(LAYOUTS["padded-left-full"])
    q, k, v, sinks = leaves
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sink_attention(q, k.bfloat16(), v.bfloat16(), sinks, **kwargs).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="share a dtype"):
        sink_attention(q, k.bfloat16(), v.bfloat16(), sinks, **kwargs)
