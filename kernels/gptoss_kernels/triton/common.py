"""Triton helpers shared by the forward and backward sink-attention kernels.

Index conventions (all kernels): positions are relative to the start of one packed document. A document
has ``len_k`` keys and ``len_q <= len_k`` queries, the last ``len_q`` positions (decoding with a KV cache,
chunked prefill; ``len_q == len_k`` for training), so query row ``m`` sits at key position
``m + off`` with ``off = len_k - len_q``. It may attend to key ``j`` iff ``j <= m + off`` (causal) and, with a
window ``W``, ``j > m + off - W`` (the last W keys including self, the GPT-OSS convention). Scores live in
the base-2 domain, ``s2 = scale*log2(e)*q.k``, so the softmax uses ``exp2``; log-sum-exps are converted back
to natural log only at the boundary. ``HEAD_DIM`` is the power of two the tiles use; a smaller real
``head_dim`` (``D_MASK``) is padded with zeros on load and never stored, which changes no dot product.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    """``a @ b`` with an fp32 accumulator.

    ``F32_DOT`` upcasts both operands and asks for IEEE fp32 products: used for fp32 inputs (so the GPU does
    not silently fall back to TF32) and under the CPU interpreter, whose bf16 ``tl.dot`` reads the raw bits
    as integers. A bf16/fp16 product is exact in fp32, so the upcast reproduces tensor-core math up to
    summation order.
    """
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _load(ptrs, row_ok, d_ok, ROW_MASK: tl.constexpr, D_MASK: tl.constexpr):
    """``tl.load`` of a tile with zeros outside the valid rows (``ROW_MASK``) and the real head dim
    (``D_MASK``); ``row_ok`` and ``d_ok`` are already shaped to broadcast against ``ptrs``."""
    if ROW_MASK and D_MASK:
        return tl.load(ptrs, mask=row_ok & d_ok, other=0.0)
    elif ROW_MASK:
        return tl.load(ptrs, mask=row_ok, other=0.0)
    elif D_MASK:
        return tl.load(ptrs, mask=d_ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _allowed(pos_m, offs_n, seq_len, window, HAS_WINDOW: tl.constexpr):
    """Boolean ``[BLOCK_M, BLOCK_N]`` tile: the query at key position ``pos_m`` may see key ``offs_n`` inside
    one document of ``seq_len`` keys (rows at or past ``seq_len`` are padding of the block)."""
    keep = (offs_n[None, :] <= pos_m[:, None]) & (pos_m[:, None] < seq_len)
    if HAS_WINDOW:
        keep = keep & (offs_n[None, :] > pos_m[:, None] - window)
    return keep


@triton.jit
def _key_range(start_m, seq_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key tiles for the query block at key positions ``[start_m, start_m + BLOCK_M)`` of a document of
    ``seq_len`` keys, split ``lo <= full_lo <= full_hi <= hi``.

    ``[lo, hi)`` is the causal/window band: loop bounds, not masks, skip every tile outside it. Tiles in
    ``[full_lo, full_hi)`` are entirely visible to every row of the block (all keys ``<= start_m``, and
    ``>= start_m + BLOCK_M - W`` with a window), so they run without the mask; the rest are masked.
    """
    hi = tl.minimum(start_m + BLOCK_M, seq_len)
    full_hi = (start_m + 1) // BLOCK_N * BLOCK_N  # <= start_m + 1 <= seq_len: no tail keys either
    lo = 0
    full_lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), full_hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_range(
    start_n, seq_len_q, off, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    """Query tiles (query-row indices, tiles start at multiples of BLOCK_M) that see the key block
    ``[start_n, start_n + BLOCK_N)``, split like ``_key_range``; query m sits at key position ``m + off``.

    Key ``j`` is seen by query positions ``j .. j + W - 1``: the last key reaches ``start_n + BLOCK_N + W - 2``.
    Query tiles in ``[full_lo, full_hi)`` see every key of the block (positions ``>= start_n + BLOCK_N - 1``,
    ``< start_n + W`` with a window, and inside the document), so they skip the mask.
    """
    lo = tl.maximum(start_n - off, 0) // BLOCK_M * BLOCK_M
    hi = seq_len_q
    full_end = seq_len_q
    if HAS_WINDOW:
        hi = tl.minimum(start_n + BLOCK_N + window - 1 - off, seq_len_q)
        full_end = tl.minimum(start_n + window - off, seq_len_q)
    full_lo = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - off, 0), BLOCK_M) * BLOCK_M, hi)
    full_lo = tl.maximum(full_lo, lo)
    full_hi = tl.maximum(tl.minimum(full_end // BLOCK_M * BLOCK_M, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _allowed_t(offs_n, pos_m, seq_len, window, HAS_WINDOW: tl.constexpr):
    """Transposed ``_allowed``: a ``[BLOCK_N, BLOCK_M]`` tile for the key-major dK/dV kernel."""
    keep = (offs_n[:, None] <= pos_m[None, :]) & (pos_m[None, :] < seq_len)
    if HAS_WINDOW:
        keep = keep & (offs_n[:, None] > pos_m[None, :] - window)
    return keep


@triton.jit
def _cast(x, dtype: tl.constexpr, BF16_RTNE: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest even. The GPU's fp32 -> bf16 cast already does; Triton 3.9's CPU
    interpreter truncates instead, a bias that would make the bf16 tests judge an interpreter artefact, so
    under the interpreter (``BF16_RTNE``) the fp32 bits are rounded first and the cast is then exact."""
    if BF16_RTNE:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
