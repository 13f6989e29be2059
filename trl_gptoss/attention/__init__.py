"""Sink attention for transformers: ``attn_implementation="fa3_sink"`` (registered by ``import trl_gptoss``)."""

from trl_gptoss.attention.interface import fa3_sink_attention_forward, register_fa3_sink
from trl_gptoss.attention.layout import (
    PackedLayout,
    SpanLayout,
    allowed_keys,
    document_ids,
    document_starts,
    layout_from_cu_seqlens,
    packed_layout,
    span_layout,
)

__all__ = [
    "PackedLayout",
    "SpanLayout",
    "allowed_keys",
    "document_ids",
    "document_starts",
    "fa3_sink_attention_forward",
    "layout_from_cu_seqlens",
    "packed_layout",
    "register_fa3_sink",
    "span_layout",
]
