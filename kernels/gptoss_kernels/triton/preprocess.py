"""Backward preprocess kernel: ``D_i = sum_d dO_i * O_i`` and each row's share of the sink gradient.

With ``P_sink,i = exp(sink_h - lse_i)`` (the sink's softmax weight in row i, head h), the sink gradient is
``dsinks[h] = -sum_i P_sink,i * D_i``. This kernel writes the per-row term ``P_sink,i * D_i``
(``[total, Hq]``, fp32); the launcher finishes with a deterministic ``-rows.sum(0)`` (no atomics, so runs
are reproducible).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sink_attention_bwd_preprocess_kernel(
    OUT,
    DO,
    LSE,
    SINKS,
    DELTA,
    DSINK_ROWS,
    total,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_lt,
    head_dim,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid ``(cdiv(total, BLOCK_T), Hq)``.

    OUT, DO: ``[total, Hq, D]``; LSE, DELTA, DSINK_ROWS: ``[total, Hq]`` fp32; SINKS: ``[Hq]`` fp32.
    """
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    offs_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_t < total
    tile_ok = row_ok[:, None] & (offs_d < head_dim)[None, :]  # HEAD_DIM may pad the real head_dim
    o = tl.load(OUT + offs_t[:, None] * stride_ot + i_h * stride_oh + offs_d[None, :], mask=tile_ok, other=0.0).to(
        tl.float32
    )
    do = tl.load(DO + offs_t[:, None] * stride_dot + i_h * stride_doh + offs_d[None, :], mask=tile_ok, other=0.0).to(
        tl.float32
    )
    delta = tl.sum(o * do, 1)
    lse = tl.load(LSE + offs_t * stride_lt + i_h, mask=row_ok, other=0.0)
    p_sink = tl.exp(tl.load(SINKS + i_h) - lse)
    tl.store(DELTA + offs_t * stride_lt + i_h, delta, mask=row_ok)
    tl.store(DSINK_ROWS + offs_t * stride_lt + i_h, p_sink * delta, mask=row_ok)
