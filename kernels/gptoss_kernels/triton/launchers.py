"""Launchers: validate, allocate outputs, pick block sizes, launch the sink-attention kernels.

Layouts (packed varlen): ``q/o/dq: [total, Hq, D]``, ``k/v/dk/dv: [total, Hkv, D]``, ``lse: [total, Hq]``
fp32, ``sinks: [Hq]``, ``cu_seqlens: int32 [n_seqs + 1]``. Each launcher returns plain tensors; autograd
lives in ``function.py``.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from gptoss_kernels.triton.backward import _sink_attention_bwd_dkdv_kernel, _sink_attention_bwd_dq_kernel
from gptoss_kernels.triton.forward import _sink_attention_fwd_kernel
from gptoss_kernels.triton.preprocess import _sink_attention_bwd_preprocess_kernel
from gptoss_kernels.validation import check_sink_attention_inputs

# Tests set this to True so that any output element a kernel fails to write stays NaN and fails loudly.
FILL_OUTPUTS_WITH_NAN = False

# Decided when triton decorated the kernels: TRITON_INTERPRET=1 must be set before triton is imported.
INTERPRETED = isinstance(_sink_attention_fwd_kernel, InterpretedFunction)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PREPROCESS_BLOCK_T = 64


def _new_output(shape, dtype, device):
    if FILL_OUTPUTS_WITH_NAN:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _check_block(name, value):
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot needs 16-wide tiles), got {value!r}")


def check_triton_inputs(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale):
    """The shared contract checks plus what the Triton kernels add: dtype, head_dim, device, max_seqlen."""
    if cu_seqlens is None:
        raise ValueError("the Triton kernel takes the packed layout: pass cu_seqlens (int32 [n_seqs + 1]) "
                         "and q/k/v shaped [total, H, D]")
    check_sink_attention_inputs(q, k, v, sinks, cu_seqlens=cu_seqlens, window=window)
    if q.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the Triton kernel takes float16/bfloat16/float32 inputs, got {q.dtype}; "
                         "use gptoss_kernels.sink_attention_ref for float64")
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim > 128 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 128] for the Triton kernel, "
                         f"got {head_dim}")
    if q.device.type != "cuda" and not (INTERPRETED and q.device.type == "cpu"):
        raise ValueError(f"q is on {q.device}: the Triton kernel needs CUDA tensors, or CPU tensors with "
                         "TRITON_INTERPRET=1 set before triton is imported")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    longest = int(lengths.max()) if lengths.numel() else 0
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < longest:
        raise ValueError(f"max_seqlen must be an int >= the longest document ({longest}), got {max_seqlen!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float (default head_dim**-0.5), got {scale!r}")


def default_block_sizes(device, head_dim):
    """``(BLOCK_M, BLOCK_N)``: FlashAttention-2 sizes on CUDA, small tiles under the (slow) interpreter."""
    if device.type != "cuda":
        return 32, 32
    return (128, 64) if head_dim <= 64 else (64, 64)


def _launch_options(device, head_dim):
    if device.type != "cuda":
        return {}
    return {"num_warps": 4 if head_dim <= 64 else 8, "num_stages": 2}


def _common_meta(q, k, window, block_m, block_n):
    return {
        "GROUP": q.shape[1] // k.shape[1], "HEAD_DIM": q.shape[2], "BLOCK_M": block_m, "BLOCK_N": block_n,
        "HAS_WINDOW": window is not None, "F32_DOT": q.dtype == torch.float32 or INTERPRETED,
    }


def sink_attention_fwd(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, block_m, block_n):
    """Forward launch. Returns ``o [total, Hq, D]`` (q's dtype), ``lse [total, Hq]`` (fp32, sink included)."""
    total, num_heads, head_dim = q.shape
    o = _new_output(q.shape, q.dtype, q.device)
    lse = _new_output((total, num_heads), torch.float32, q.device)
    n_seqs = cu_seqlens.numel() - 1
    if total == 0 or max_seqlen == 0:
        return o, lse
    sinks32 = sinks.detach().to(torch.float32).contiguous()
    grid = (n_seqs * num_heads, triton.cdiv(max_seqlen, block_m))
    _sink_attention_fwd_kernel[grid](
        q, k, v, sinks32, o, lse, cu_seqlens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), lse.stride(0), scale, window or 0,
        NUM_HEADS=num_heads, **_common_meta(q, k, window, block_m, block_n),
        **_launch_options(q.device, head_dim),
    )
    return o, lse


def sink_attention_bwd_preprocess(o, do, lse, sinks):
    """``delta = rowsum(dO*O)`` (``[total, Hq]`` fp32), ``dsinks = -sum_rows exp(sink - lse)*delta``."""
    total, num_heads, head_dim = o.shape
    delta = _new_output((total, num_heads), torch.float32, o.device)
    dsink_rows = _new_output((total, num_heads), torch.float32, o.device)
    if total == 0:
        return delta, torch.zeros(num_heads, dtype=torch.float32, device=o.device)
    sinks32 = sinks.detach().to(torch.float32).contiguous()
    grid = (triton.cdiv(total, _PREPROCESS_BLOCK_T), num_heads)
    _sink_attention_bwd_preprocess_kernel[grid](
        o, do, lse, sinks32, delta, dsink_rows, total,
        o.stride(0), o.stride(1), do.stride(0), do.stride(1), lse.stride(0),
        HEAD_DIM=head_dim, BLOCK_T=_PREPROCESS_BLOCK_T,
    )
    return delta, -dsink_rows.sum(0)


def sink_attention_bwd(q, k, v, sinks, o, lse, do, cu_seqlens, max_seqlen, window, scale, block_m, block_n):
    """Backward launch. Returns ``dq, dk, dv`` (in q/k/v's dtype) and ``dsinks`` (in sinks' dtype)."""
    total, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    dq = _new_output(q.shape, q.dtype, q.device)
    dk = _new_output(k.shape, k.dtype, k.device)
    dv = _new_output(v.shape, v.dtype, v.device)
    delta, dsinks = sink_attention_bwd_preprocess(o, do, lse, sinks)
    if total == 0 or max_seqlen == 0:
        return dq, dk, dv, dsinks.to(sinks.dtype)
    n_seqs = cu_seqlens.numel() - 1
    meta = _common_meta(q, k, window, block_m, block_n)
    options = _launch_options(q.device, head_dim)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               do.stride(0), do.stride(1))
    _sink_attention_bwd_dq_kernel[(n_seqs * num_heads, triton.cdiv(max_seqlen, block_m))](
        q, k, v, do, lse, delta, dq, cu_seqlens, *strides, dq.stride(0), dq.stride(1), lse.stride(0),
        scale, window or 0, NUM_HEADS=num_heads, **meta, **options,
    )
    _sink_attention_bwd_dkdv_kernel[(n_seqs * num_kv_heads, triton.cdiv(max_seqlen, block_n))](
        q, k, v, do, lse, delta, dk, dv, cu_seqlens, *strides,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0),
        scale, window or 0, NUM_KV_HEADS=num_kv_heads, **meta, **options,
    )
    return dq, dk, dv, dsinks.to(sinks.dtype)
