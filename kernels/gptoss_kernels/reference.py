"""Plain PyTorch reference for causal attention with learnable sinks (the contract every backend meets).

For query row i of head h, with keys j allowed by the causal (and optional sliding-window) mask::

    S_ij   = scale * q_i . k_j
    lse_i  = log( exp(sinks[h]) + sum_j exp(S_ij) )      # the sink joins the denominator ...
    o_i    = sum_j exp(S_ij - lse_i) * v_j                # ... but contributes no value

so ``o_i = o_plain_i * sigmoid(lse_plain_i - sinks[h])``. ``window=W`` keeps the last W keys including
the query's own position (GPT-OSS / transformers semantics, not flex's W+1). Readability over speed:
this materialises the full [Hq, Tq, Tk] score matrix per sequence and runs in any dtype, float64 included.
"""

from __future__ import annotations

import torch

from gptoss_kernels.autocast import autocast_inputs, autocast_off
from gptoss_kernels.validation import check_sink_attention_inputs


def _attend_one(q, k, v, sinks, window, scale, key_valid=None):
    """One sequence. q: [Tq, Hq, D], k/v: [Tk, Hkv, D] (Tk >= Tq, queries are the last Tq positions);
    ``key_valid``: optional bool [Tk], False = a padding key no query may see."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(tk - tq, tk, device=q.device)[:, None]
    k_pos = torch.arange(tk, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    if key_valid is not None:
        allowed &= key_valid[None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink_col = sinks.to(scores.dtype)[:, None, None].expand(hq, tq, 1)
    combined = torch.cat([scores, sink_col], dim=-1)
    # A row with no key and a -inf sink sees nothing: its lse is -inf and its output 0. Its logsumexp is taken
    # over zeros and then replaced, so neither the value nor the gradient meets -inf - -inf = NaN.
    empty = (combined == float("-inf")).all(dim=-1)
    lse_safe = torch.logsumexp(combined.masked_fill(empty[..., None], 0.0), dim=-1)  # [Hq, Tq]
    lse = lse_safe.masked_fill(empty, float("-inf"))
    probs = torch.exp(scores - lse_safe.masked_fill(empty, 0.0)[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, lse.transpose(0, 1)  # [Tq, Hq, D], [Tq, Hq]


def sink_attention_ref(
    q, k, v, sinks, *, cu_seqlens=None, max_seqlen=None, window=None, scale=None, key_mask=None, return_lse=False
):
    """Reference sink attention.

    Layouts: batched ``q: [B, Tq, Hq, D]``, ``k, v: [B, Tk, Hkv, D]`` with ``Tk >= Tq`` (queries are the
    last ``Tq`` positions, as in decoding with a KV cache); or packed ``q, k, v: [total, H, D]`` with
    ``cu_seqlens: int32 [n_seqs + 1]`` (documents never attend to each other). ``sinks: [Hq]``.
    ``key_mask``: batched only, bool ``[B, Tk]``, False = a padding key (any pattern, holes included);
    a query row that sees no key returns 0.
    Returns ``o`` shaped like ``q`` (in q's dtype), and with ``return_lse`` also ``lse`` in float32/64:
    ``[B, Tq, Hq]`` or ``[total, Hq]``; lse includes the sink. Under ``torch.autocast`` q, k, v are cast to
    the autocast dtype, as for every backend, and the math then runs with autocast off (``autocast.py``).
    """
    q, k, v = autocast_inputs(q, k, v)
    check_sink_attention_inputs(
        q, k, v, sinks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window, key_mask=key_mask
    )
    with autocast_off(q.device):
        return _reference(q, k, v, sinks, cu_seqlens, window, scale, key_mask, return_lse)


def _reference(q, k, v, sinks, cu_seqlens, window, scale, key_mask, return_lse):
    """``sink_attention_ref`` on checked inputs: fp32 math (float64 for float64 inputs), one sequence at a time."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc, sc = (t.to(compute) for t in (q, k, v, sinks))
    if cu_seqlens is None:
        pieces = [
            _attend_one(qc[b], kc[b], vc[b], sc, window, scale, None if key_mask is None else key_mask[b])
            for b in range(q.shape[0])
        ]
        out = torch.stack([p[0] for p in pieces]) if pieces else qc.new_empty(q.shape)
        lse = torch.stack([p[1] for p in pieces]) if pieces else qc.new_empty(q.shape[:-1])
    else:
        bounds = cu_seqlens.tolist()
        out = qc.new_zeros(q.shape)
        lse = qc.new_zeros(q.shape[:-1])
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                out[start:end], lse[start:end] = _attend_one(
                    qc[start:end], kc[start:end], vc[start:end], sc, window, scale
                )
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
