"""``attn_implementation="fa3_sink"``: GPT-OSS attention through ``gptoss_kernels.sink_attention``.

Registered in transformers' ``AttentionInterface`` (the attention itself) and ``AttentionMaskInterface``
(transformers hands a custom implementation ``attention_mask=None`` unless a mask function is registered
for its name; we reuse the flash-attention one, which yields None or a 2-D keep-mask ``[B, Tk]``).
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import flash_attention_mask
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from gptoss_kernels import sink_attention, sink_attention_intervals
from trl_gptoss import FA3_SINK
from trl_gptoss.attention.layout import (
    PackedLayout,
    allowed_keys,
    document_ids,
    layout_from_cu_seqlens,
    packed_layout,
    span_layout,
)

logger = logging.getLogger(__name__)


def _sinks_for(s_aux, num_heads, device):
    """The model's sinks (kept differentiable), or -inf sinks (plain causal attention) when it has none."""
    if s_aux is None:
        return torch.full((num_heads,), float("-inf"), dtype=torch.float32, device=device)
    return s_aux


def _check_call(attention_mask, dropout, is_causal, batch, q_len, k_len):
    if dropout:
        raise ValueError(f"fa3_sink has no attention dropout, got dropout={dropout}; set config.attention_dropout=0.0")
    if not is_causal:
        raise ValueError("fa3_sink implements causal attention only (GPT-OSS is causal); got is_causal=False")
    if attention_mask is not None and (
        attention_mask.dim() != 2 or attention_mask.shape[-1] > k_len or attention_mask.shape[0] != batch
    ):
        raise ValueError(
            f"fa3_sink expects a 2-D keep-mask [B={batch}, <= {k_len}] or None, got shape "
            f"{tuple(attention_mask.shape)}; import trl_gptoss before building masks so AttentionMaskInterface "
            "knows 'fa3_sink'"
        )
    if q_len > k_len:
        raise ValueError(f"query length {q_len} exceeds key length {k_len}")


def _attend_packed(q, k, v, sinks, layout: PackedLayout, window, scale):
    """q: [B, T, Hq, D] (k/v with Hkv) -> gather the layout's tokens, attend as varlen, scatter back
    (rows outside ``layout.token_index`` come back as 0)."""
    batch, seqlen, hq, dim = q.shape
    flat = [t.reshape(batch * seqlen, t.shape[2], dim) for t in (q, k, v)]
    if layout.token_index is not None:
        flat = [t.index_select(0, layout.token_index) for t in flat]
    out = sink_attention(
        *flat, sinks, cu_seqlens=layout.cu_seqlens, max_seqlen=layout.max_seqlen, window=window, scale=scale
    )
    if layout.token_index is not None:
        out = out.new_zeros(batch * seqlen, hq, dim).index_copy(0, layout.token_index, out)
    return out.view(batch, seqlen, hq, dim)


def _attend_padded(q, k, v, sinks, attention_mask, window, scale):
    """A 2-D keep-mask ``[B, Tk]``: every query row attends to the valid keys it may see (padding masks
    keys, not queries, as in eager). Left/right padding with ``Tq == Tk`` takes the varlen path for the
    valid tokens plus the interval path for padding queries that still see keys; any other mask the
    batched path with a key-validity mask."""
    spans = span_layout(attention_mask) if q.shape[1] == k.shape[1] else None
    if spans is None:
        return sink_attention(q, k, v, sinks, key_mask=attention_mask.bool(), window=window, scale=scale)
    out = _attend_packed(q, k, v, sinks, spans.packed, window, scale)
    pad = spans.pad_intervals(window, q.device)
    if pad is None:
        return out
    rows, intervals = pad
    batch, seqlen, hq, dim = q.shape
    flat_k, flat_v = (t.reshape(batch * seqlen, t.shape[2], dim) for t in (k, v))
    pad_q = q.reshape(batch * seqlen, hq, dim).index_select(0, rows)
    pad_out = sink_attention_intervals(pad_q, flat_k, flat_v, sinks, intervals, scale=scale)
    return out.reshape(batch * seqlen, hq, dim).index_copy(0, rows, pad_out).view(q.shape)


def _documents(kwargs, batch, q_len, device):
    """The packed layout of a ``Tq == Tk`` call without padding mask, or None for plain rows."""
    if kwargs.get("cu_seq_lens_q") is not None and batch == 1:
        return layout_from_cu_seqlens(
            kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_q"), q_len, device
        )
    return packed_layout(batch, q_len, kwargs.get("position_ids"), device)


def _eager_with_weights(module, q, k, v, sinks, attention_mask, window, scale, kwargs):
    """``output_attentions=True``: the same masks (padding keys, causal, window, documents) through
    transformers' GPT-OSS eager attention, which returns the weights."""
    batch, q_len, k_len = q.shape[0], q.shape[1], k.shape[1]
    doc_ids = None
    positions = kwargs.get("position_ids")
    if attention_mask is None and q_len == k_len:
        if kwargs.get("cu_seq_lens_q") is not None and batch == 1:
            layout = _documents(kwargs, batch, q_len, q.device)
            doc_ids = torch.bucketize(torch.arange(q_len, device=q.device), layout.cu_seqlens[1:], right=True)[None]
        elif positions is not None and positions.dim() == 2 and positions.shape[-1] == q_len:
            doc_ids = document_ids(positions.to(q.device).expand(batch, q_len))
    allowed = allowed_keys(batch, q_len, k_len, window, attention_mask, doc_ids).to(q.device)
    additive = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
        ~allowed, torch.finfo(q.dtype).min
    )[:, None]
    view = _SinksView(module, sinks)
    return eager_attention_forward(view, *(t.transpose(1, 2) for t in (q, k, v)), additive, scaling=scale)


class _SinksView:
    """The module as eager sees it, with the sinks this call uses (``s_aux`` or -inf when absent)."""

    def __init__(self, module, sinks):
        self._module, self.sinks = module, sinks
        self.num_key_value_groups = getattr(module, "num_key_value_groups", 1)
        self.training = getattr(module, "training", False)

    def __getattr__(self, name):
        return getattr(self._module, name)


def fa3_sink_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, s_aux=None, **kwargs
):
    """transformers attention function: ``query [B, Hq, Tq, D]``, ``key/value [B, Hkv, Tk, D]`` (RoPE
    applied, cache already appended; queries are the last Tq positions) -> ``([B, Tq, Hq, D], None)``.

    ``s_aux``: ``[Hq]`` sink logits (GPT-OSS passes ``module.sinks``; gradient flows), None = no sinks.
    ``sliding_window=W``: the last W tokens including self. Padding from the 2-D ``attention_mask`` (any
    pattern); without one, packing from ``cu_seq_lens_q/k`` kwargs or from ``position_ids`` (see layout.py).
    ``output_attentions=True`` (kwarg): warned once, computed by eager attention with the same masks,
    returning ``(output, weights [B, Hq, Tq, Tk])``.
    """
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    batch, q_len, num_heads, _ = q.shape
    _check_call(
        attention_mask, dropout, kwargs.get("is_causal", getattr(module, "is_causal", True)), batch, q_len, k.shape[1]
    )
    sinks = _sinks_for(s_aux, num_heads, q.device)
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    if attention_mask is not None and attention_mask.shape[-1] < k.shape[1]:
        # A static cache hands over its whole buffer; the mask covers the filled prefix, which ends at the
        # current queries (transformers' flash path slices keys the same way).
        k, v = k[:, : attention_mask.shape[-1]], v[:, : attention_mask.shape[-1]]
    if kwargs.get("output_attentions"):
        _warn_output_attentions()
        return _eager_with_weights(module, q, k, v, sinks, attention_mask, sliding_window, scaling, kwargs)
    if attention_mask is not None:
        return _attend_padded(q, k, v, sinks, attention_mask, sliding_window, scaling), None
    layout = _documents(kwargs, batch, q_len, q.device) if q_len == k.shape[1] else None
    if layout is None:
        return sink_attention(q, k, v, sinks, window=sliding_window, scale=scaling), None
    return _attend_packed(q, k, v, sinks, layout, sliding_window, scaling), None


_WARNED = []


def _warn_output_attentions():
    if not _WARNED:
        _WARNED.append(True)
        logger.warning(
            "fa3_sink does not materialise attention weights: output_attentions=True runs these "
            "layers with eager attention (O(T^2) memory, same masks and sinks) to return them"
        )


def register_fa3_sink(name: str = FA3_SINK) -> None:
    """Register ``name`` globally in ``AttentionInterface`` and ``AttentionMaskInterface`` (idempotent)."""
    AttentionInterface.register(name, fa3_sink_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
