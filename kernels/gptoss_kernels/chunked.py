"""Memory-efficient, exact sink attention in plain PyTorch: the CPU backend (runs on any device).

Same contract as ``sink_attention_ref``. For query row i of head h and its allowed keys j::

    S_ij  = scale * q_i . k_j
    lse_i = log( exp(sinks[h]) + sum_j exp(S_ij) )
    o_i   = sum_j exp(S_ij - lse_i) * v_j

Every layout is reduced to one picture: queries and keys flattened to ``[Nq, Hq, D]`` / ``[Nk, Hkv, D]``,
and each query row i attends to the contiguous key interval ``[lo_i, hi_i]`` of the flattened keys
(document start or window start .. its own position). Both bounds are non-decreasing in i, so a chunk of
query rows needs only the key band ``[lo_first, hi_last]``; tiles outside the band are never computed.

Forward: FlashAttention-style online softmax over key tiles whose running max and sum START FROM THE
SINK (``m = s_h``, ``l = 1``), so the sink is in the denominator from the first tile. Saves ``(o, lse)``.
Backward: recomputes ``P = exp(S - lse)`` per tile (no T x T tensor is ever kept), with
``D_i = rowsum(dO_i * O_i)``, ``dS = P * (dP - D)``, and ``dsinks[h] = -sum_i exp(s_h - lse_i) * D_i``.
GQA is done by viewing the ``G = Hq / Hkv`` query heads of a group as extra rows of one matmul against
their shared key/value head, so K and V are never repeated. Peak extra memory is a few tiles of
``Hq * q_chunk * key_chunk`` floats plus the (float32) gradients, i.e. O(T * chunk), not O(T^2).
"""

from __future__ import annotations

import bisect
import functools
from typing import NamedTuple

import torch

from gptoss_kernels.autocast import autocast_inputs, without_autocast
from gptoss_kernels.validation import check_sink_attention_inputs, check_sinks, check_tensors

# Score-tile budget in elements (Hq * q rows * keys). Measured on a 2-core CPU at GPT-OSS shape (64 heads):
# 64 query rows x 512 keys (2**21 fp32 = 8 MiB per tile) runs fwd+bwd ~1.5x faster than 256 x 512 (32 MiB),
# because the softmax's elementwise passes then stay in cache; the window-128 band of a 64-row chunk
# (191 keys) is one tile, and few live tiles keep the peak far below eager's T^2.
DEFAULT_TILE_ELEMENTS = 2**21
DEFAULT_Q_CHUNK = 64


def _compute_dtype(dtype):
    """fp32 accumulation for fp16/bf16/fp32 inputs; float64 stays float64 (for reference-grade checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def key_intervals(q_shape, k_shape, cu_seqlens, window, device):
    """Per flattened query row, the inclusive key interval ``[lo, hi]`` it may attend to (device tensors).

    Packed (``cu_seqlens``): row i of a document starting at ``s`` has ``hi = i``, ``lo = s``.
    Batched ``[B, Tq, ...]`` / ``[B, Tk, ...]``: queries are the last Tq positions of their row, so
    ``hi = b * Tk + Tk - Tq + i``, ``lo = b * Tk``. A window W then raises ``lo`` to ``hi - W + 1``.
    Returns two int64 tensors of shape ``[Nq]``; no device->host copy.
    """
    if cu_seqlens is not None:
        bounds = cu_seqlens.to(device=device, dtype=torch.int64)
        lengths = bounds[1:] - bounds[:-1]
        hi = torch.arange(q_shape[0], device=device)
        lo = torch.repeat_interleave(bounds[:-1], lengths, output_size=q_shape[0])
    else:
        batch, tq, tk = q_shape[0], q_shape[1], k_shape[1]
        row_start = (torch.arange(batch, device=device) * tk)[:, None]
        hi = (row_start + (tk - tq) + torch.arange(tq, device=device)[None, :]).reshape(-1)
        lo = row_start.expand(batch, tq).reshape(-1)
    if window is not None:
        lo = torch.maximum(lo, hi - (window - 1))
    return lo, hi


def _host_row_bounds(layout, window, r0, r1):
    """The same intervals as ``key_intervals`` for rows ``[r0, r1)``, computed on the host from ``layout``:
    ``("packed", bounds)``, ``("batched", tq, tk)`` or ``("rows", lo_list, hi_list)``."""
    if layout[0] == "rows":
        return list(layout[1][r0:r1]), list(layout[2][r0:r1])
    if layout[0] == "packed":
        bounds = layout[1]
        his = list(range(r0, r1))
        los = [bounds[bisect.bisect_right(bounds, r) - 1] for r in his]
    else:
        tq, tk = layout[1], layout[2]
        his = [(r // tq) * tk + tk - tq + r % tq for r in range(r0, r1)]
        los = [(r // tq) * tk for r in range(r0, r1)]
    if window is not None:
        los = [max(lo, hi - window + 1) for lo, hi in zip(los, his)]
    return los, his


@functools.lru_cache(maxsize=256)
def tile_plan(layout, n_rows, window, q_chunk, key_chunk, always_mask):
    """Host plan of the chunked loops: per query chunk ``(r0, r1, ((k0, k1, masked), ...))``.

    Computed from host numbers only (``layout`` is hashable, see ``_host_row_bounds``) and cached, so a layer
    called with an already validated layout reads nothing back from the device. Both interval bounds are
    non-decreasing in the row, so the chunk's key band is ``[lo_first, hi_last]``; a tile is skipped when no
    row sees it and runs without a mask when every row sees all of it (and no key-validity mask is given).
    """
    plan = []
    for r0 in range(0, n_rows, q_chunk):
        r1 = min(r0 + q_chunk, n_rows)
        los, his = _host_row_bounds(layout, window, r0, r1)
        rows = [(lo, hi) for lo, hi in zip(los, his) if lo <= hi]
        tiles = []
        if rows:
            has_empty = len(rows) < len(los)
            row_his = [hi for _, hi in rows]
            for k0 in range(rows[0][0], rows[-1][1] + 1, key_chunk):
                k1 = min(k0 + key_chunk, rows[-1][1] + 1)
                first = bisect.bisect_left(row_his, k0)  # first row reaching the tile
                if first == len(rows) or rows[first][0] >= k1:
                    continue
                masked = always_mask or has_empty or not (rows[-1][0] <= k0 and rows[0][1] >= k1 - 1)
                tiles.append((k0, k1, masked))
        plan.append((r0, r1, tuple(tiles)))
    return tuple(plan)


def _tile_mask(lo_c, hi_c, k0, k1, key_valid):
    """Bool ``[C, k1 - k0]``: True where key ``k0 + c`` lies in row r's interval and is a valid key."""
    keys = torch.arange(k0, k1, device=lo_c.device)
    mask = (keys[None, :] >= lo_c[:, None]) & (keys[None, :] <= hi_c[:, None])
    return mask if key_valid is None else mask & key_valid[None, k0:k1]


def _scores(q_c, k_h, k0, k1, mask, shape):
    """``S = q_c k^T`` for one tile as ``[Hkv, G, C, Kc]`` with disallowed entries set to -inf."""
    scores = torch.bmm(q_c, k_h[:, k0:k1].transpose(1, 2)).view(*shape, k1 - k0)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return scores


def _chunk_rows(t, r0, r1, hkv, dtype, scale=1.0):
    """Rows ``[r0, r1)`` of a ``[N, H, D]`` tensor as one matmul operand ``[Hkv, G*C, D]`` in ``dtype``.

    Only the chunk is copied (q head h = kv head h // G, group member h % G), so no full head-major copy
    of q or dO is ever held.
    """
    rows, heads, dim = r1 - r0, t.shape[1], t.shape[2]
    chunk = t[r0:r1].to(dtype).reshape(rows, hkv, heads // hkv, dim).permute(1, 2, 0, 3)
    chunk = chunk.reshape(hkv, heads // hkv * rows, dim)
    return chunk * scale if scale != 1.0 else chunk


def _forward_chunk(q_c, k_h, v_h, sinks_g, lo_c, hi_c, tiles, key_valid):
    """Online softmax for one query chunk. Returns ``acc / l`` ``[Hkv, G, C, D]`` and lse ``[Hkv, G, C]``."""
    hkv, group = sinks_g.shape
    rows, dim = lo_c.shape[0], q_c.shape[-1]
    shape = (hkv, group, rows)
    # The sink starts the running max/sum: m = s_h, l = exp(s_h - m) = 1 (0 when the sink is -inf).
    m = sinks_g[:, :, None].expand(shape).clone()
    l_sum = (m > float("-inf")).to(q_c.dtype)
    acc = q_c.new_zeros(hkv, group * rows, dim)
    for k0, k1, masked in tiles:
        mask = _tile_mask(lo_c, hi_c, k0, k1, key_valid) if masked else None
        scores = _scores(q_c, k_h, k0, k1, mask, shape)
        m_new = torch.maximum(m, scores.amax(dim=-1))
        # A row that has seen neither a finite sink nor a key keeps m = -inf; shift by 0 to avoid inf - inf.
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
        alpha = torch.exp(m - m_safe)
        probs = scores.sub_(m_safe[..., None]).exp_()
        l_sum = l_sum * alpha + probs.sum(dim=-1)
        acc.view(*shape, dim).mul_(alpha[..., None])
        acc.baddbmm_(probs.view(hkv, group * rows, k1 - k0), v_h[:, k0:k1])
        m = m_new
    # l = 0 only for a row that saw no key under a -inf sink: its output is 0 and its lse -inf.
    out = acc.view(*shape, dim) / l_sum.masked_fill(l_sum == 0, 1.0)[..., None]
    return out, m + torch.log(l_sum)


def _backward_chunk(q_c, do_c, k_h, v_h, lse_c, delta_c, lo_c, hi_c, tiles, key_valid, dk_h, dv_h):
    """Recompute P per tile; returns dq for the chunk ``[Hkv, G*C, D]`` and accumulates into dk_h, dv_h."""
    hkv, group, rows = lse_c.shape
    shape = (hkv, group, rows)
    dq_c = torch.zeros_like(q_c)
    for k0, k1, masked in tiles:
        mask = _tile_mask(lo_c, hi_c, k0, k1, key_valid) if masked else None
        probs = _scores(q_c, k_h, k0, k1, mask, shape).sub_(lse_c[..., None]).exp_()
        probs_2d = probs.view(hkv, group * rows, k1 - k0)
        dv_h[:, k0:k1].baddbmm_(probs_2d.transpose(1, 2), do_c)
        dscores = torch.bmm(do_c, v_h[:, k0:k1].transpose(1, 2)).view(*shape, k1 - k0)
        dscores.sub_(delta_c[..., None]).mul_(probs)  # dS = P * (dP - D)
        dscores_2d = dscores.view(hkv, group * rows, k1 - k0)
        dq_c.baddbmm_(dscores_2d, k_h[:, k0:k1])
        dk_h[:, k0:k1].baddbmm_(dscores_2d.transpose(1, 2), q_c)
    return dq_c


def _new_output(*shape, dtype, device):
    """Uninitialised output buffer; every row is written by a chunk (tests fill it with NaN to prove it)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _key_chunk_for(hq, q_chunk, key_chunk):
    if key_chunk is not None:
        return key_chunk
    return max(q_chunk, DEFAULT_TILE_ELEMENTS // (hq * q_chunk))


class ChunkedSinkAttention(torch.autograd.Function):
    """Flattened layout: q ``[Nq, Hq, D]``, k/v ``[Nk, Hkv, D]``, sinks ``[Hq]``, lo/hi int64 ``[Nq]``,
    ``key_valid`` bool ``[Nk]`` or None, ``plan`` from ``tile_plan``."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, sinks, lo, hi, key_valid, plan, scale):
        nq, hq, dim = q.shape
        hkv = k.shape[1]
        dtype = _compute_dtype(q.dtype)
        kh = k.to(dtype).permute(1, 0, 2).contiguous()
        vh = v.to(dtype).permute(1, 0, 2).contiguous()
        sinks_g = sinks.detach().to(dtype).view(hkv, hq // hkv)
        out = _new_output(nq, hkv, hq // hkv, dim, dtype=dtype, device=q.device)
        lse = _new_output(nq, hkv, hq // hkv, dtype=dtype, device=q.device)
        for r0, r1, tiles in plan:
            q_c = _chunk_rows(q, r0, r1, hkv, dtype, scale)
            o_c, lse_c = _forward_chunk(q_c, kh, vh, sinks_g, lo[r0:r1], hi[r0:r1], tiles, key_valid)
            out[r0:r1] = o_c.permute(2, 0, 1, 3)
            lse[r0:r1] = lse_c.permute(2, 0, 1)
        out, lse = out.view(nq, hq, dim), lse.view(nq, hq)
        ctx.save_for_backward(q, k, v, sinks, lo, hi, key_valid, out, lse)
        ctx.scale, ctx.plan = scale, plan
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    @without_autocast
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, sinks, lo, hi, key_valid, out, lse = ctx.saved_tensors
        nq, hq, dim = q.shape
        hkv, group = k.shape[1], hq // k.shape[1]
        dtype = out.dtype
        kh = k.to(dtype).permute(1, 0, 2).contiguous()
        vh = v.to(dtype).permute(1, 0, 2).contiguous()
        # Rows that saw nothing (lse = -inf) have P = 0 everywhere: recompute them against lse = 0 (no NaN).
        lse = lse.masked_fill(lse == float("-inf"), 0.0)
        lse_h = lse.t().reshape(hkv, group, nq)
        delta = torch.bmm(grad_out.to(dtype).reshape(-1, 1, dim), out.reshape(-1, dim, 1))  # D_i = dO_i . O_i
        delta_h = delta.view(nq, hq).t().reshape(hkv, group, nq)
        dq = _new_output(nq, hkv, group, dim, dtype=dtype, device=q.device)
        dk_h, dv_h = torch.zeros_like(kh), torch.zeros_like(vh)
        for r0, r1, tiles in ctx.plan:
            q_c = _chunk_rows(q, r0, r1, hkv, dtype, ctx.scale)
            do_c = _chunk_rows(grad_out, r0, r1, hkv, dtype)
            dq_c = _backward_chunk(
                q_c,
                do_c,
                kh,
                vh,
                lse_h[:, :, r0:r1],
                delta_h[:, :, r0:r1],
                lo[r0:r1],
                hi[r0:r1],
                tiles,
                key_valid,
                dk_h,
                dv_h,
            )
            dq[r0:r1] = dq_c.view(hkv, group, r1 - r0, dim).permute(2, 0, 1, 3)
        dq = dq.view(nq, hq, dim).mul_(ctx.scale).to(q.dtype)
        dk = dk_h.permute(1, 0, 2).to(k.dtype)
        dv = dv_h.permute(1, 0, 2).to(v.dtype)
        dsinks = None
        if ctx.needs_input_grad[3]:
            sink_prob = torch.exp(sinks.to(dtype)[:, None] - lse.t())  # [Hq, Nq]
            dsinks = -(sink_prob * delta_h.reshape(hq, nq)).sum(-1).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None


def check_tuning(q_chunk, key_chunk, scale, head_dim) -> float:
    """Check the chunk sizes and the scale; returns the scale as a float (default ``head_dim ** -0.5``)."""
    for name, value in (("q_chunk", q_chunk), ("key_chunk", key_chunk)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    scale = head_dim**-0.5 if scale is None else scale
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive number (default head_dim ** -0.5), got {scale!r}")
    return float(scale)


def sink_attention_chunked(
    q,
    k,
    v,
    sinks,
    *,
    cu_seqlens=None,
    max_seqlen=None,
    window=None,
    scale=None,
    key_mask=None,
    return_lse=False,
    q_chunk=DEFAULT_Q_CHUNK,
    key_chunk=None,
):
    """Chunked sink attention (see the module docstring for the math); differentiable in q, k, v, sinks.

    Layouts as ``sink_attention_ref``: batched ``q: [B, Tq, Hq, D]``, ``k, v: [B, Tk, Hkv, D]`` with
    ``Tk >= Tq`` (queries are the last Tq positions), or packed ``[total, H, D]`` with int32 ``cu_seqlens``.
    ``key_mask`` (batched only): bool ``[B, Tk]``, False = padding key, any pattern; a query row that sees
    no key returns 0. ``q_chunk`` query rows are processed at a time against key tiles of ``key_chunk`` keys
    (default: as many as fit ``DEFAULT_TILE_ELEMENTS`` for all heads). ``max_seqlen`` is only checked.
    Returns ``o`` like ``q`` (and with ``return_lse`` the sink-inclusive lse ``[B, Tq, Hq]`` or
    ``[total, Hq]`` in float32, float64 for float64 inputs; ``-inf`` for a row with no key and no sink).
    Under ``torch.autocast`` q, k, v run in the autocast dtype (see ``autocast.py``).
    """
    q, k, v = autocast_inputs(q, k, v)
    info = check_sink_attention_inputs(
        q, k, v, sinks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window, key_mask=key_mask
    )
    return run_sink_attention_chunked(
        q, k, v, sinks, info, cu_seqlens, window, scale, key_mask, q_chunk, key_chunk, return_lse
    )


def run_sink_attention_chunked(
    q, k, v, sinks, info, cu_seqlens, window, scale, key_mask, q_chunk=DEFAULT_Q_CHUNK, key_chunk=None, return_lse=False
):
    """Inputs already checked by ``check_sink_attention_inputs`` (``info`` is what it returned: the packed
    layout's ``CuSeqlensInfo`` or None) -> the autograd function on the flattened layout.

    Arguments and result as ``sink_attention_chunked``; reads nothing back from the device.
    """
    scale = check_tuning(q_chunk, key_chunk, scale, q.shape[-1])
    layout = ("packed", info.bounds) if info is not None else ("batched", q.shape[1], k.shape[1])
    hq, dim, hkv = q.shape[-2], q.shape[-1], k.shape[-2]
    key_chunk = _key_chunk_for(hq, q_chunk, key_chunk)
    if window is not None and window >= k.reshape(-1, hkv, dim).shape[0]:
        window = None  # longer than every row: the same attention, and a plan shared with window=None
    n_rows = q.reshape(-1, hq, dim).shape[0]
    plan = tile_plan(layout, n_rows, window, q_chunk, key_chunk, key_mask is not None)
    lo, hi = key_intervals(q.shape, k.shape, cu_seqlens, window, q.device)
    key_valid = None if key_mask is None else key_mask.reshape(-1)
    out, lse = ChunkedSinkAttention.apply(
        q.reshape(-1, hq, dim), k.reshape(-1, hkv, dim), v.reshape(-1, hkv, dim), sinks, lo, hi, key_valid, plan, scale
    )
    out, lse = out.view(q.shape), lse.view(q.shape[:-1])
    return (out, lse) if return_lse else out


class RowIntervals(NamedTuple):
    """Inclusive key intervals of arbitrary query rows: host tuples (the tile plan) + device int64 tensors
    (the tile masks). Build once with ``row_intervals`` and reuse: calls then copy nothing either way."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]
    lo_t: torch.Tensor
    hi_t: torch.Tensor


def row_intervals(lo, hi, device) -> RowIntervals:
    """Check and pack host sequences ``lo``/``hi`` (one per query row, each non-decreasing; ``lo > hi``
    means the row sees no key) for ``sink_attention_intervals``."""
    lo, hi = tuple(int(x) for x in lo), tuple(int(x) for x in hi)
    if len(lo) != len(hi):
        raise ValueError(f"lo and hi need one entry per query row, got {len(lo)} and {len(hi)}")
    for name, seq in (("lo", lo), ("hi", hi)):
        if any(b < a for a, b in zip(seq[:-1], seq[1:])):
            raise ValueError(f"{name} must be non-decreasing along the query rows")
    if lo and lo[0] < 0:
        raise ValueError(f"key intervals must start at key 0 or later, got lo[0]={lo[0]}")
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return RowIntervals(lo, hi, as_tensor(lo), as_tensor(hi))


def sink_attention_intervals(
    q, k, v, sinks, intervals: RowIntervals, *, scale=None, q_chunk=DEFAULT_Q_CHUNK, key_chunk=None
):
    """Sink attention of arbitrary query rows over key intervals (what padded rows of a batch need).

    ``q: [Nq, Hq, D]``, ``k, v: [Nk, Hkv, D]``; query row r attends to keys ``lo[r] .. hi[r]`` of
    ``intervals`` (inclusive, empty when ``lo > hi``: that row returns 0). Differentiable in q, k, v, sinks.
    """
    q, k, v = autocast_inputs(q, k, v)
    check_tensors(q, k, v, 3, "[N, H, D]")
    check_sinks(sinks, q.shape[1], q.device)
    if len(intervals.lo) != q.shape[0]:
        raise ValueError(f"intervals has {len(intervals.lo)} rows but q has {q.shape[0]}")
    if intervals.hi and intervals.hi[-1] >= k.shape[0]:
        raise ValueError(f"key intervals must end before key {k.shape[0]}, got hi[-1]={intervals.hi[-1]}")
    if intervals.lo_t.device != q.device:
        raise ValueError(f"intervals were built for {intervals.lo_t.device} but q is on {q.device}")
    scale = check_tuning(q_chunk, key_chunk, scale, q.shape[-1])
    key_chunk = _key_chunk_for(q.shape[1], q_chunk, key_chunk)
    plan = tile_plan(("rows", intervals.lo, intervals.hi), q.shape[0], None, q_chunk, key_chunk, False)
    out, _ = ChunkedSinkAttention.apply(q, k, v, sinks, intervals.lo_t, intervals.hi_t, None, plan, scale)
    return out
