"""Forward Triton kernel: FlashAttention-2 tiling with the online softmax started from the sink.

For one (document, query head, query block) program, with base-2 scores ``s2_ij = scale*log2(e)*q_i.k_j``
and ``sink2 = sinks[h]*log2(e)``::

    m_i <- sink2, l_i <- 1, acc_i <- 0                    # the sink is the first "key": exp2(sink2 - m) = 1
    for each key tile in the causal/window band:
        m_new = max(m_i, rowmax(s2));  a = exp2(m_i - m_new);  p = exp2(s2 - m_new)
        l_i = a*l_i + rowsum(p);       acc_i = a*acc_i + p @ V;  m_i = m_new
    o_i = acc_i / l_i;   lse_i = ln2 * (m_i + log2 l_i)   # natural log, sink included

Because m starts at the (finite) sink, masked scores (-inf) give exp2(-inf) = 0, never NaN, and a row that
sees no key ends with lse = sink, o = 0 exactly. ``sinks[h] = -inf`` is plain causal attention (l starts at
an empty sum once the first key rescales it by exp2(-inf) = 0).
"""

from __future__ import annotations

import triton
import triton.language as tl

from gptoss_kernels.triton.common import LN2, LOG2E, _allowed, _cast, _dot, _key_range, _load


@triton.jit
def _fwd_tiles(
    acc,
    l_i,
    m_i,
    q,
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
    """Online-softmax update over the key tiles ``[start, end)``; ``MASKED=False`` only for tiles every row
    of the block fully sees (no causal/window/tail mask to build). Returns the new ``(acc, l_i, m_i)``."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = K + (bos_k + offs_n)[None, :] * stride_kt + i_kh * stride_kh + offs_d[:, None]  # [D, BLOCK_N]
        v_ptrs = V + (bos_k + offs_n)[:, None] * stride_vt + i_kh * stride_vh + offs_d[None, :]  # [BLOCK_N, D]
        k_t = _load(k_ptrs, (offs_n < seq_len)[None, :], (offs_d < head_dim)[:, None], MASKED, D_MASK)
        v = _load(v_ptrs, (offs_n < seq_len)[:, None], (offs_d < head_dim)[None, :], MASKED, D_MASK)
        s = _dot(q, k_t, F32_DOT) * qk_scale
        if MASKED:
            s = tl.where(_allowed(pos_m, offs_n, seq_len, window, HAS_WINDOW), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A sink of -inf means "no sink": until a row meets its first key its max is -inf, and
        # exp2(-inf - -inf) would be NaN, so exponentiate against 0 instead (every term is 0 then).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # p is rounded to V's dtype before the product, as every FlashAttention kernel does.
        acc = acc * alpha[:, None] + _dot(_cast(p, v.dtype, BF16_RTNE), v, F32_DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _sink_attention_fwd_kernel(
    Q,
    K,
    V,
    SINKS,
    OUT,
    LSE,
    CU_SEQLENS,
    CU_SEQLENS_K,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
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
    """Grid ``(n_seqs * Hq, cdiv(max_seqlen_q, BLOCK_M))``. Q/OUT ``[total_q, Hq, D]``, K/V
    ``[total_k, Hkv, D]``, LSE ``[total_q, Hq]`` fp32, SINKS ``[Hq]`` fp32, CU_SEQLENS (queries) and
    CU_SEQLENS_K (keys; the same tensor for self-attention) int32 ``[n_seqs + 1]``."""
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
    off = seq_len - seq_len_q  # queries are the last seq_len_q key positions

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
    qk_scale = scale * LOG2E

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINKS + i_h) * LOG2E
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

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
        qk_scale,
    )
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, *tiles, lo, full_lo, HEAD_DIM, BLOCK_N, HAS_WINDOW, F32_DOT, BF16_RTNE, True, D_MASK
    )
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, *tiles, full_lo, full_hi, HEAD_DIM, BLOCK_N, HAS_WINDOW, F32_DOT, BF16_RTNE, False, D_MASK
    )
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, *tiles, full_hi, hi, HEAD_DIM, BLOCK_N, HAS_WINDOW, F32_DOT, BF16_RTNE, True, D_MASK
    )

    # l is 0 only for padding rows past the document end under a -inf sink; they are never stored.
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2
    out_ptrs = OUT + (bos + offs_m)[:, None] * stride_ot + i_h * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, _cast(o, OUT.dtype.element_ty, BF16_RTNE), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + (bos + offs_m) * stride_lt + i_h, lse, mask=row_ok)
