"""``attn_implementation="sinkless"``: GPT-OSS attention that silently drops the sinks, for the ablation.

This is what training with flash-attention 2/3 did in the GPT-OSS retrospective: the kernel has no sink
argument, transformers drops ``s_aux`` without a word, and the policy being trained is no longer the one the
sink-aware rollout engine samples from. Here it is torch's SDPA (causal, padding mask) called without the
sinks. Registered on import; only ``examples/sink_ablation.py`` and the docs use it.
"""

from __future__ import annotations

from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

SINKLESS = "sinkless"


def sinkless_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """``sdpa_attention_forward`` with ``s_aux`` removed: softmax over the keys only, no sink column."""
    kwargs.pop("s_aux", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(SINKLESS, sinkless_attention_forward)
AttentionMaskInterface.register(SINKLESS, sdpa_mask)
