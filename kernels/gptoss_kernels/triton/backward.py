"""Backward Triton kernels (FlashAttention-2 split): one pass for dQ, one key-major pass for dK and dV.

Both recompute the probabilities from the saved sink-inclusive ``lse`` instead of storing them::

    P = exp(S - lse)            (S = scale * Q K^T; the sink column is already inside lse)
    dV = P^T dO     dP = dO V^T     dS = P * (dP - D)     dQ = scale * dS K     dK = scale * dS^T Q

with ``D = rowsum(dO * O)`` from the preprocess kernel. The sink adds no term to dQ/dK/dV beyond living in
``lse`` and ``D``. dK/dV of a kv head sum over the ``GROUP`` query heads that share it (GQA), inside one
program, so no atomics are needed. Scores are base-2 as in the forward: ``exp2(s2 - lse*log2(e))``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gptoss_kernels.triton.common import LOG2E, _allowed, _allowed_t, _cast, _dot, _key_range, _query_range


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, K, V, bos, i_kh, stride_kt, stride_kh, stride_vt, stride_vh,
              offs_m, seq_len, window, qk_scale, start, end,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
              F32_DOT: tl.constexpr, BF16_RTNE: tl.constexpr, MASKED: tl.constexpr):
    """Accumulate ``dS K`` (unscaled) over the key tiles ``[start, end)`` for one query block."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = K + (bos + offs_n)[:, None] * stride_kt + i_kh * stride_kh + offs_d[None, :]
        v_ptrs = V + (bos + offs_n)[:, None] * stride_vt + i_kh * stride_vh + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=(offs_n < seq_len)[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n < seq_len)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        p = tl.math.exp2(_dot(q, tl.trans(k), F32_DOT) * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(_allowed(offs_m, offs_n, seq_len, window, HAS_WINDOW), p, 0.0)
        dp = _dot(do, tl.trans(v), F32_DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(_cast(ds, k.dtype, BF16_RTNE), k, F32_DOT)
    return dq


@triton.jit
def _sink_attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_SEQLENS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lt, scale, window,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, F32_DOT: tl.constexpr,
    BF16_RTNE: tl.constexpr,
):
    """Grid ``(n_seqs * Hq, cdiv(max_seqlen, BLOCK_M))``; DQ ``[total, Hq, D]`` in q's dtype."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // NUM_HEADS, i_nh % NUM_HEADS
    i_kh = i_h // GROUP
    start_m = tl.program_id(1) * BLOCK_M
    bos = tl.load(CU_SEQLENS + i_n).to(tl.int64)
    seq_len = (tl.load(CU_SEQLENS + i_n + 1) - tl.load(CU_SEQLENS + i_n)).to(tl.int32)
    if start_m >= seq_len:
        return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    q = tl.load(Q + (bos + offs_m)[:, None] * stride_qt + i_h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + (bos + offs_m)[:, None] * stride_dot + i_h * stride_doh + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE + (bos + offs_m) * stride_lt + i_h, mask=row_ok, other=0.0) * LOG2E
    delta = tl.load(DELTA + (bos + offs_m) * stride_lt + i_h, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _key_range(start_m, seq_len, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    tiles = (K, V, bos, i_kh, stride_kt, stride_kh, stride_vt, stride_vh, offs_m, seq_len, window, scale * LOG2E)
    dq = _dq_tiles(dq, q, do, lse2, delta, *tiles, lo, full_lo,
                   HEAD_DIM, BLOCK_N, HAS_WINDOW, F32_DOT, BF16_RTNE, True)
    dq = _dq_tiles(dq, q, do, lse2, delta, *tiles, full_lo, full_hi,
                   HEAD_DIM, BLOCK_N, HAS_WINDOW, F32_DOT, BF16_RTNE, False)
    dq = _dq_tiles(dq, q, do, lse2, delta, *tiles, full_hi, hi,
                   HEAD_DIM, BLOCK_N, HAS_WINDOW, F32_DOT, BF16_RTNE, True)

    tl.store(DQ + (bos + offs_m)[:, None] * stride_dqt + i_h * stride_dqh + offs_d[None, :],
             _cast(dq * scale, DQ.dtype.element_ty, BF16_RTNE), mask=row_ok[:, None])


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q, DO, LSE, DELTA, bos, i_h, stride_qt, stride_qh, stride_dot, stride_doh,
                stride_lt, offs_n, seq_len, window, qk_scale, start, end,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_WINDOW: tl.constexpr,
                F32_DOT: tl.constexpr, BF16_RTNE: tl.constexpr, MASKED: tl.constexpr):
    """Accumulate ``P^T dO`` into dv and ``dS^T Q`` (unscaled) into dk over the query tiles ``[start, end)``
    of head ``i_h``; scores are kept transposed, ``[BLOCK_N, BLOCK_M]``."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = Q + (bos + offs_m)[:, None] * stride_qt + i_h * stride_qh + offs_d[None, :]
        do_ptrs = DO + (bos + offs_m)[:, None] * stride_dot + i_h * stride_doh + offs_d[None, :]
        if MASKED:
            row_ok = offs_m < seq_len
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(LSE + (bos + offs_m) * stride_lt + i_h, mask=row_ok, other=0.0) * LOG2E
            delta = tl.load(DELTA + (bos + offs_m) * stride_lt + i_h, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse2 = tl.load(LSE + (bos + offs_m) * stride_lt + i_h) * LOG2E
            delta = tl.load(DELTA + (bos + offs_m) * stride_lt + i_h)
        p_t = tl.math.exp2(_dot(k, tl.trans(q), F32_DOT) * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(_allowed_t(offs_n, offs_m, seq_len, window, HAS_WINDOW), p_t, 0.0)
        dv += _dot(_cast(p_t, do.dtype, BF16_RTNE), do, F32_DOT)
        ds_t = p_t * (_dot(v, tl.trans(do), F32_DOT) - delta[None, :])
        dk += _dot(_cast(ds_t, q.dtype, BF16_RTNE), q, F32_DOT)
    return dk, dv


@triton.jit
def _sink_attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_SEQLENS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lt, scale, window,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, F32_DOT: tl.constexpr,
    BF16_RTNE: tl.constexpr,
):
    """Grid ``(n_seqs * Hkv, cdiv(max_seqlen, BLOCK_N))``; DK/DV ``[total, Hkv, D]`` in k's dtype.

    Key-major: the program owns one key tile, walks the query tiles that can see it (causal/window band
    only) for each of the GROUP query heads, accumulating dK and dV ``[BLOCK_N, D]`` in fp32.
    """
    i_nkh = tl.program_id(0)
    i_n, i_kh = i_nkh // NUM_KV_HEADS, i_nkh % NUM_KV_HEADS
    start_n = tl.program_id(1) * BLOCK_N
    bos = tl.load(CU_SEQLENS + i_n).to(tl.int64)
    seq_len = (tl.load(CU_SEQLENS + i_n + 1) - tl.load(CU_SEQLENS + i_n)).to(tl.int32)
    if start_n >= seq_len:
        return

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < seq_len
    k = tl.load(K + (bos + offs_n)[:, None] * stride_kt + i_kh * stride_kh + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + (bos + offs_n)[:, None] * stride_vt + i_kh * stride_vh + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _query_range(start_n, seq_len, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    for g in range(GROUP):
        tiles = (Q, DO, LSE, DELTA, bos, i_kh * GROUP + g, stride_qt, stride_qh, stride_dot, stride_doh,
                 stride_lt, offs_n, seq_len, window, scale * LOG2E)
        dk, dv = _dkdv_tiles(dk, dv, k, v, *tiles, lo, full_lo,
                             HEAD_DIM, BLOCK_M, HAS_WINDOW, F32_DOT, BF16_RTNE, True)
        dk, dv = _dkdv_tiles(dk, dv, k, v, *tiles, full_lo, full_hi,
                             HEAD_DIM, BLOCK_M, HAS_WINDOW, F32_DOT, BF16_RTNE, False)
        dk, dv = _dkdv_tiles(dk, dv, k, v, *tiles, full_hi, hi,
                             HEAD_DIM, BLOCK_M, HAS_WINDOW, F32_DOT, BF16_RTNE, True)

    tl.store(DK + (bos + offs_n)[:, None] * stride_dkt + i_kh * stride_dkh + offs_d[None, :],
             _cast(dk * scale, DK.dtype.element_ty, BF16_RTNE), mask=col_ok[:, None])
    tl.store(DV + (bos + offs_n)[:, None] * stride_dvt + i_kh * stride_dvh + offs_d[None, :],
             _cast(dv, DV.dtype.element_ty, BF16_RTNE), mask=col_ok[:, None])
