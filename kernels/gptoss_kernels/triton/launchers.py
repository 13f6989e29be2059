"""Launchers: allocate outputs, pick block sizes, launch the sink-attention kernels (inputs are validated
once, at the public entry: ``sink_attention`` or ``sink_attention_triton``).

Layouts (packed varlen): ``q/o/dq: [total, Hq, D]``, ``k/v/dk/dv: [total, Hkv, D]``, ``lse: [total, Hq]``
fp32, ``sinks: [Hq]``, ``cu_seqlens: int32 [n_seqs + 1]``. Each launcher returns plain tensors; autograd
lives in ``function.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from gptoss_kernels.triton.backward import _sink_attention_bwd_dkdv_kernel, _sink_attention_bwd_dq_kernel
from gptoss_kernels.triton.forward import _sink_attention_fwd_kernel
from gptoss_kernels.triton.preprocess import _sink_attention_bwd_preprocess_kernel

# Tests set this to True so that any output element a kernel fails to write stays NaN and fails loudly.
FILL_OUTPUTS_WITH_NAN = False

# Decided when triton decorated the kernels: TRITON_INTERPRET=1 must be set before triton is imported.
INTERPRETED = isinstance(_sink_attention_fwd_kernel, InterpretedFunction)

_PREPROCESS_BLOCK_T = 64


def _new_output(shape, dtype, device):
    if FILL_OUTPUTS_WITH_NAN:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _check_block(name, value):
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot needs 16-wide tiles), got {value!r}")


class LaunchConfig(NamedTuple):
    """Tile sizes and CUDA launch options of one pass (forward, or the dQ and dK/dV backward kernels)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def launch_config(device_type, head_dim, backward, block_sizes=None, dtype=torch.bfloat16):
    """``LaunchConfig`` for one pass: the caller's ``(BLOCK_M, BLOCK_N)``, 32x32 under the slow interpreter,
    or FlashAttention-2 tiles on CUDA: fwd 128x64 for 16-bit D <= 64 (fp32 tiles take twice the shared
    memory, so 64x64 there), bwd 64x64 so the dK, dV, Q and dO tiles stay in registers."""
    if block_sizes is not None:
        if not isinstance(block_sizes, (tuple, list)) or len(block_sizes) != 2:
            raise ValueError(f"block_sizes must be a pair (BLOCK_M, BLOCK_N), got {block_sizes!r}")
        block_m, block_n = block_sizes
        _check_block("BLOCK_M", block_m)
        _check_block("BLOCK_N", block_n)
    elif device_type != "cuda":
        block_m, block_n = 32, 32
    elif backward or head_dim > 64 or dtype == torch.float32:
        block_m, block_n = 64, 64
    else:
        block_m, block_n = 128, 64
    num_warps = 8 if block_m * max(block_n, head_dim) >= 128 * 64 else 4
    return LaunchConfig(block_m, block_n, num_warps, 2 if backward or dtype == torch.float32 else 3)


def padded_head_dim(head_dim):
    """The power of two >= 16 the tiles use for ``head_dim`` (``tl.dot`` and ``tl.arange`` need it)."""
    return max(16, triton.next_power_of_2(head_dim))


def kernel_meta(dtype, group, head_dim, has_window, config):
    """Compile-time arguments shared by the forward, dQ and dK/dV kernels (also used by ``aot.py``)."""
    tile_dim = padded_head_dim(head_dim)
    return {
        "GROUP": group,
        "HEAD_DIM": tile_dim,
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "HAS_WINDOW": has_window,
        "F32_DOT": dtype == torch.float32 or INTERPRETED,
        "BF16_RTNE": INTERPRETED and dtype == torch.bfloat16,
        "D_MASK": tile_dim != head_dim,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }


def _meta(q, k, window, config):
    return kernel_meta(q.dtype, q.shape[1] // k.shape[1], q.shape[2], window is not None, config)


def sink_attention_fwd(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, block_sizes=None, cu_seqlens_k=None):
    """Forward launch. Returns ``o [total_q, Hq, D]`` (q's dtype), ``lse [total_q, Hq]`` (fp32, sink
    included). ``cu_seqlens_k`` (default ``cu_seqlens``): key documents, each at least as long as its
    queries, which are its last positions; ``max_seqlen`` is the longest query document."""
    total, num_heads, head_dim = q.shape
    o = _new_output(q.shape, q.dtype, q.device)
    lse = _new_output((total, num_heads), torch.float32, q.device)
    n_seqs = cu_seqlens.numel() - 1
    if total == 0 or max_seqlen == 0:
        return o, lse
    config = launch_config(
        q.device.type, padded_head_dim(head_dim), backward=False, block_sizes=block_sizes, dtype=q.dtype
    )
    sinks32 = sinks.detach().to(torch.float32).contiguous()
    grid = (n_seqs * num_heads, triton.cdiv(max_seqlen, config.block_m))
    _sink_attention_fwd_kernel[grid](
        Q=q,
        K=k,
        V=v,
        SINKS=sinks32,
        OUT=o,
        LSE=lse,
        CU_SEQLENS=cu_seqlens,
        CU_SEQLENS_K=cu_seqlens if cu_seqlens_k is None else cu_seqlens_k,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_ot=o.stride(0),
        stride_oh=o.stride(1),
        stride_lt=lse.stride(0),
        scale=scale,
        window=window or 0,
        head_dim=head_dim,
        NUM_HEADS=num_heads,
        **_meta(q, k, window, config),
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
        OUT=o,
        DO=do,
        LSE=lse,
        SINKS=sinks32,
        DELTA=delta,
        DSINK_ROWS=dsink_rows,
        total=total,
        stride_ot=o.stride(0),
        stride_oh=o.stride(1),
        stride_dot=do.stride(0),
        stride_doh=do.stride(1),
        stride_lt=lse.stride(0),
        head_dim=head_dim,
        HEAD_DIM=padded_head_dim(head_dim),
        BLOCK_T=_PREPROCESS_BLOCK_T,
    )
    return delta, -dsink_rows.sum(0)


def sink_attention_bwd(
    q,
    k,
    v,
    sinks,
    o,
    lse,
    do,
    cu_seqlens,
    max_seqlen,
    window,
    scale,
    block_sizes=None,
    cu_seqlens_k=None,
    max_seqlen_k=None,
):
    """Backward launch. Returns ``dq, dk, dv`` (in q/k/v's dtype) and ``dsinks`` (in sinks' dtype).
    ``cu_seqlens_k`` / ``max_seqlen_k`` default to the query ones (self-attention)."""
    total, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    cu_seqlens_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    max_seqlen_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    dq = _new_output(q.shape, q.dtype, q.device)
    delta, dsinks = sink_attention_bwd_preprocess(o, do, lse, sinks)
    if total == 0 or max_seqlen == 0:  # no query: no key receives a gradient
        return dq, torch.zeros_like(k), torch.zeros_like(v), dsinks.to(sinks.dtype)
    dk = _new_output(k.shape, k.dtype, k.device)
    dv = _new_output(v.shape, v.dtype, v.device)
    n_seqs = cu_seqlens.numel() - 1
    config = launch_config(
        q.device.type, padded_head_dim(head_dim), backward=True, block_sizes=block_sizes, dtype=q.dtype
    )
    # Arguments the dQ and dK/dV kernels share, by the kernels' own parameter names.
    shared = dict(
        Q=q,
        K=k,
        V=v,
        DO=do,
        LSE=lse,
        DELTA=delta,
        CU_SEQLENS=cu_seqlens,
        CU_SEQLENS_K=cu_seqlens_k,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_dot=do.stride(0),
        stride_doh=do.stride(1),
        stride_lt=lse.stride(0),
        scale=scale,
        window=window or 0,
        head_dim=head_dim,
        **_meta(q, k, window, config),
    )
    _sink_attention_bwd_dq_kernel[(n_seqs * num_heads, triton.cdiv(max_seqlen, config.block_m))](
        DQ=dq, stride_dqt=dq.stride(0), stride_dqh=dq.stride(1), NUM_HEADS=num_heads, **shared
    )
    _sink_attention_bwd_dkdv_kernel[(n_seqs * num_kv_heads, triton.cdiv(max_seqlen_k, config.block_n))](
        DK=dk,
        DV=dv,
        stride_dkt=dk.stride(0),
        stride_dkh=dk.stride(1),
        stride_dvt=dv.stride(0),
        stride_dvh=dv.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        **shared,
    )
    return dq, dk, dv, dsinks.to(sinks.dtype)
