"""``attn_implementation="fa3_sink"``: GPT-OSS attention through ``gptoss_kernels.sink_attention``.

Registered in transformers' ``AttentionInterface`` (the attention itself) and ``AttentionMaskInterface``
(transformers hands a custom implementation ``attention_mask=None`` unless a mask function is registered
for its name; we reuse the flash-attention one, which yields None or a 2-D keep-mask ``[B, Tk]``).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import flash_attention_mask

from gptoss_kernels import sink_attention
from trl_gptoss.attention.layout import PackedLayout, layout_from_cu_seqlens, packed_layout, valid_spans

FA3_SINK_NAME = "fa3_sink"


def _sinks_for(s_aux, num_heads, device):
    """The model's sinks (kept differentiable), or -inf sinks (plain causal attention) when it has none."""
    if s_aux is None:
        return torch.full((num_heads,), float("-inf"), dtype=torch.float32, device=device)
    return s_aux


def _check_call(attention_mask, dropout, is_causal, q_len, k_len):
    if dropout:
        raise ValueError(f"fa3_sink has no attention dropout, got dropout={dropout}; set config.attention_dropout=0.0")
    if not is_causal:
        raise ValueError("fa3_sink implements causal attention only (GPT-OSS is causal); got is_causal=False")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[-1] > k_len):
        raise ValueError(
            f"fa3_sink expects a 2-D keep-mask [B, <= {k_len}] or None, got shape {tuple(attention_mask.shape)}; "
            "import trl_gptoss before building masks so AttentionMaskInterface knows 'fa3_sink'")
    if q_len > k_len:
        raise ValueError(f"query length {q_len} exceeds key length {k_len}")


def _attend_packed(q, k, v, sinks, layout: PackedLayout, window, scale):
    """q: [B, T, Hq, D] (k/v with Hkv) -> gather the layout's tokens, attend as varlen, scatter back."""
    batch, seqlen, hq, dim = q.shape
    flat = [t.reshape(batch * seqlen, t.shape[2], dim).index_select(0, layout.token_index) for t in (q, k, v)]
    out = sink_attention(*flat, sinks, cu_seqlens=layout.cu_seqlens, max_seqlen=layout.max_seqlen,
                         window=window, scale=scale)
    full = out.new_zeros(batch * seqlen, hq, dim).index_copy(0, layout.token_index, out)
    return full.view(batch, seqlen, hq, dim)


def _attend_decoding(q, k, v, sinks, attention_mask, window, scale):
    """Tq < Tk with padding: each row's valid keys ``[start, end)``; its queries sit at absolute positions
    ``Tk - Tq + i`` and only those inside the span are real tokens (the rest return zeros)."""
    batch, q_len = q.shape[:2]
    offset = k.shape[1] - q_len
    out = q.new_zeros(q.shape)
    starts, ends = valid_spans(attention_mask)
    for row, (start, end) in enumerate(zip(starts, ends)):
        first = max(start, offset)
        if end <= first:
            continue
        row_q = q[row:row + 1, first - offset:end - offset]
        row_out = sink_attention(row_q, k[row:row + 1, start:end], v[row:row + 1, start:end], sinks,
                                 window=window, scale=scale)
        out[row:row + 1, first - offset:end - offset] = row_out
    return out


def fa3_sink_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               sliding_window=None, s_aux=None, **kwargs):
    """transformers attention function: ``query [B, Hq, Tq, D]``, ``key/value [B, Hkv, Tk, D]`` (RoPE
    applied, cache already appended; queries are the last Tq positions) -> ``([B, Tq, Hq, D], None)``.

    ``s_aux``: ``[Hq]`` sink logits (GPT-OSS passes ``module.sinks``; gradient flows), None = no sinks.
    ``sliding_window=W``: the last W tokens including self. Packing comes from ``cu_seq_lens_q/k`` kwargs,
    or from ``position_ids`` that restart inside a row; padding from the 2-D ``attention_mask``.
    """
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    batch, q_len, num_heads, _ = q.shape
    _check_call(attention_mask, dropout, kwargs.get("is_causal", getattr(module, "is_causal", True)),
                q_len, k.shape[1])
    sinks = _sinks_for(s_aux, num_heads, q.device)
    if attention_mask is not None and attention_mask.shape[-1] < k.shape[1]:
        # A static cache hands over its whole buffer; the mask covers the filled prefix, which ends at the
        # current queries (transformers' flash path slices keys the same way).
        k, v = k[:, :attention_mask.shape[-1]], v[:, :attention_mask.shape[-1]]
    if q_len < k.shape[1]:
        if attention_mask is None:
            out = sink_attention(q, k, v, sinks, window=sliding_window, scale=scaling)
        else:
            out = _attend_decoding(q, k, v, sinks, attention_mask, sliding_window, scaling)
        return out, None
    if kwargs.get("cu_seq_lens_q") is not None and attention_mask is None and batch == 1:
        layout = layout_from_cu_seqlens(kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k"),
                                        kwargs.get("max_length_q"), q_len, q.device)
    else:
        layout = packed_layout(batch, q_len, attention_mask, kwargs.get("position_ids"), q.device)
    if layout is None:
        return sink_attention(q, k, v, sinks, window=sliding_window, scale=scaling), None
    return _attend_packed(q, k, v, sinks, layout, sliding_window, scaling), None


def register_fa3_sink(name: str = FA3_SINK_NAME) -> None:
    """Register ``name`` globally in ``AttentionInterface`` and ``AttentionMaskInterface`` (idempotent)."""
    AttentionInterface.register(name, fa3_sink_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
