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

from gptoss_kernels.triton.common import (
    LOG2E,
    _allowed,
    _allowed_t,
    _cast,
    _dot,
    _key_range,
    _load,
    _query_range,
)


@triton.jit
def _dq_tiles(
    dq,
    q,
    do,
    lse2,
    delta,
    K,
    V,
    bos_k,
    i_kh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    pos_m,
    seq_len,
    head_dim,
    window,
    qk_scale,
    start,
    end,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    F32_DOT: tl.constexpr,
    BF16_RTNE: tl.constexpr,
    MASKED: tl.constexpr,
    D_MASK: tl.constexpr,
):
    """Accumulate ``dS K`` (unscaled) over the key tiles ``[start, end)`` for one query block."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = K + (bos_k + offs_n)[:, None] * stride_kt + i_kh * stride_kh + offs_d[None, :]
        v_ptrs = V + (bos_k + offs_n)[:, None] * stride_vt + i_kh * stride_vh + offs_d[None, :]
        k = _load(k_ptrs, (offs_n < seq_len)[:, None], (offs_d < head_dim)[None, :], MASKED, D_MASK)
        v = _load(v_ptrs, (offs_n < seq_len)[:, None], (offs_d < head_dim)[None, :], MASKED, D_MASK)
        p = tl.math.exp2(_dot(q, tl.trans(k), F32_DOT) * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(_allowed(pos_m, offs_n, seq_len, window, HAS_WINDOW), p, 0.0)
        dp = _dot(do, tl.trans(v), F32_DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(_cast(ds, k.dtype, BF16_RTNE), k, F32_DOT)
    return dq


@triton.jit
def _sink_attention_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    CU_SEQLENS,
    CU_SEQLENS_K,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_lt,
    scale,
    window,
    head_dim,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    F32_DOT: tl.constexpr,
    BF16_RTNE: tl.constexpr,
    D_MASK: tl.constexpr,
):
    """Grid ``(n_seqs * Hq, cdiv(max_seqlen_q, BLOCK_M))``; DQ ``[total_q, Hq, D]`` in q's dtype."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // NUM_HEADS, i_nh % NUM_HEADS
    i_kh = i_h // GROUP
    start_m = tl.program_id(1) * BLOCK_M
    bos = tl.load(CU_SEQLENS + i_n).to(tl.int64)
    seq_len_q = (tl.load(CU_SEQLENS + i_n + 1) - tl.load(CU_SEQLENS + i_n)).to(tl.int32)
    if start_m >= seq_len_q:
        return
    bos_k = tl.load(CU_SEQLENS_K + i_n).to(tl.int64)
    seq_len = (tl.load(CU_SEQLENS_K + i_n + 1) - tl.load(CU_SEQLENS_K + i_n)).to(tl.int32)
    off = seq_len - seq_len_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len_q
    d_ok = offs_d < head_dim
    q = _load(
        Q + (bos + offs_m)[:, None] * stride_qt + i_h * stride_qh + offs_d[None, :],
        row_ok[:, None],
        d_ok[None, :],
        True,
        D_MASK,
    )
    do = _load(
        DO + (bos + offs_m)[:, None] * stride_dot + i_h * stride_doh + offs_d[None, :],
        row_ok[:, None],
        d_ok[None, :],
        True,
        D_MASK,
    )
    lse2 = tl.load(LSE + (bos + offs_m) * stride_lt + i_h, mask=row_ok, other=0.0) * LOG2E
    delta = tl.load(DELTA + (bos + offs_m) * stride_lt + i_h, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _key_range(start_m + off, seq_len, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    tiles = (
        K,
        V,
        bos_k,
        i_kh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        offs_m + off,
        seq_len,
        head_dim,
        window,
        scale * LOG2E,
    )
    dq = _dq_tiles(
        dq, q, do, lse2, delta, *tiles, lo, full_lo, HEAD_DIM, BLOCK_N, HAS_WINDOW, F32_DOT, BF16_RTNE, True, D_MASK
    )
    dq = _dq_tiles(
        dq,
        q,
        do,
        lse2,
        delta,
        *tiles,
        full_lo,
        full_hi,
        HEAD_DIM,
        BLOCK_N,
        HAS_WINDOW,
        F32_DOT,
        BF16_RTNE,
        False,
        D_MASK,
    )
    dq = _dq_tiles(
        dq, q, do, lse2, delta, *tiles, full_hi, hi, HEAD_DIM, BLOCK_N, HAS_WINDOW, F32_DOT, BF16_RTNE, True, D_MASK
    )

    tl.store(
        DQ + (bos + offs_m)[:, None] * stride_dqt + i_h * stride_dqh + offs_d[None, :],
        _cast(dq * scale, DQ.dtype.element_ty, BF16_RTNE),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _dkdv_tiles(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    LSE,
    DELTA,
    bos,
    i_h,
    stride_qt,
    stride_qh,
    stride_dot,
    stride_doh,
    stride_lt,
    offs_n,
    seq_len_q,
    off,
    seq_len,
    head_dim,
    window,
    qk_scale,
    start,
    end,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    F32_DOT: tl.constexpr,
    BF16_RTNE: tl.constexpr,
    MASKED: tl.constexpr,
    D_MASK: tl.constexpr,
):
    """Accumulate ``P^T dO`` into dv and ``dS^T Q`` (unscaled) into dk over the query tiles ``[start, end)``
    (query-row indices) of head ``i_h``; scores are kept transposed, ``[BLOCK_N, BLOCK_M]``."""
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = (offs_d < head_dim)[None, :]
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = Q + (bos + offs_m)[:, None] * stride_qt + i_h * stride_qh + offs_d[None, :]
        do_ptrs = DO + (bos + offs_m)[:, None] * stride_dot + i_h * stride_doh + offs_d[None, :]
        row_ok = offs_m < seq_len_q
        q = _load(q_ptrs, row_ok[:, None], d_ok, MASKED, D_MASK)
        do = _load(do_ptrs, row_ok[:, None], d_ok, MASKED, D_MASK)
        if MASKED:
            lse2 = tl.load(LSE + (bos + offs_m) * stride_lt + i_h, mask=row_ok, other=0.0) * LOG2E
            delta = tl.load(DELTA + (bos + offs_m) * stride_lt + i_h, mask=row_ok, other=0.0)
        else:
            lse2 = tl.load(LSE + (bos + offs_m) * stride_lt + i_h) * LOG2E
            delta = tl.load(DELTA + (bos + offs_m) * stride_lt + i_h)
        p_t = tl.math.exp2(_dot(k, tl.trans(q), F32_DOT) * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(_allowed_t(offs_n, offs_m + off, seq_len, window, HAS_WINDOW), p_t, 0.0)
        dv += _dot(_cast(p_t, do.dtype, BF16_RTNE), do, F32_DOT)
        ds_t = p_t * (_dot(v, tl.trans(do), F32_DOT) - delta[None, :])
        dk += _dot(_cast(ds_t, q.dtype, BF16_RTNE), q, F32_DOT)
    return dk, dv


@triton.jit
def _sink_attention_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    CU_SEQLENS,
    CU_SEQLENS_K,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_lt,
    scale,
    window,
    head_dim,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    F32_DOT: tl.constexpr,
    BF16_RTNE: tl.constexpr,
    D_MASK: tl.constexpr,
):
    """Grid ``(n_seqs * Hkv, cdiv(max_seqlen_k, BLOCK_N))``; DK/DV ``[total_k, Hkv, D]`` in k's dtype.

    Key-major: the program owns one key tile, walks the query tiles that can see it (causal/window band
    only) for each of the GROUP query heads, accumulating dK and dV ``[BLOCK_N, D]`` in fp32.
    """
    i_nkh = tl.program_id(0)
    i_n, i_kh = i_nkh // NUM_KV_HEADS, i_nkh % NUM_KV_HEADS
    start_n = tl.program_id(1) * BLOCK_N
    bos_k = tl.load(CU_SEQLENS_K + i_n).to(tl.int64)
    seq_len = (tl.load(CU_SEQLENS_K + i_n + 1) - tl.load(CU_SEQLENS_K + i_n)).to(tl.int32)
    if start_n >= seq_len:
        return
    bos = tl.load(CU_SEQLENS + i_n).to(tl.int64)
    seq_len_q = (tl.load(CU_SEQLENS + i_n + 1) - tl.load(CU_SEQLENS + i_n)).to(tl.int32)
    off = seq_len - seq_len_q

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < seq_len
    d_ok = offs_d < head_dim
    k = _load(
        K + (bos_k + offs_n)[:, None] * stride_kt + i_kh * stride_kh + offs_d[None, :],
        col_ok[:, None],
        d_ok[None, :],
        True,
        D_MASK,
    )
    v = _load(
        V + (bos_k + offs_n)[:, None] * stride_vt + i_kh * stride_vh + offs_d[None, :],
        col_ok[:, None],
        d_ok[None, :],
        True,
        D_MASK,
    )
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _query_range(start_n, seq_len_q, off, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    for g in range(GROUP):
        tiles = (
            Q,
            DO,
            LSE,
            DELTA,
            bos,
            i_kh * GROUP + g,
            stride_qt,
            stride_qh,
            stride_dot,
            stride_doh,
            stride_lt,
            offs_n,
            seq_len_q,
            off,
            seq_len,
            head_dim,
            window,
            scale * LOG2E,
        )
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, *tiles, lo, full_lo, HEAD_DIM, BLOCK_M, HAS_WINDOW, F32_DOT, BF16_RTNE, True, D_MASK
        )
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, *tiles, full_lo, full_hi, HEAD_DIM, BLOCK_M, HAS_WINDOW, F32_DOT, BF16_RTNE, False, D_MASK
        )
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, *tiles, full_hi, hi, HEAD_DIM, BLOCK_M, HAS_WINDOW, F32_DOT, BF16_RTNE, True, D_MASK
        )

    tile_ok = col_ok[:, None] & d_ok[None, :]
    tl.store(
        DK + (bos_k + offs_n)[:, None] * stride_dkt + i_kh * stride_dkh + offs_d[None, :],
        _cast(dk * scale, DK.dtype.element_ty, BF16_RTNE),
        mask=tile_ok,
    )
    tl.store(
        DV + (bos_k + offs_n)[:, None] * stride_dvt + i_kh * stride_dvh + offs_d[None, :],
        _cast(dv, DV.dtype.element_ty, BF16_RTNE),
        mask=tile_ok,
    )
