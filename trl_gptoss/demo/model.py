"""A tiny GPT-OSS with the real o200k Harmony vocabulary, built offline for the CPU demo.

It keeps what makes GPT-OSS GPT-OSS for RL: the 201,088-entry Harmony vocabulary (so prompts, tool calls and
tool outputs are the token ids a real checkpoint sees), learnable attention sinks, alternating sliding/full
attention, GQA, a top-k MoE with the clamped SwiGLU, YaRN RoPE. ``head_dim`` is 64 because vLLM's CPU
attention backend supports no smaller head. The vocabulary dominates the parameter count:
``2 * 201088 * hidden_size`` (embedding + untied head; vLLM's GPT-OSS loader expects an untied ``lm_head``).

Sinks start at ``U(SINK_INIT_RANGE)``: large, as in trained GPT-OSS checkpoints, so attention that ignores
them is measurably wrong.

The initialisation gives the model a *copy prior*, standing in for pre-training: embedding rows at norm
``EMBEDDING_NORM``, ``lm_head`` starting as their (untied) copy, and identity value/output projections in the
last layer, so "attend to a token, predict it" is a path that already exists and the warm-start only has to
learn where to attend. Why, and what it measured without it: docs/quickstart.md ("The demo's design").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GptOssConfig, GptOssForCausalLM

from trl_gptoss.harmony.tokens import CALL, RETURN

SINK_INIT_RANGE = (0.0, 3.0)
EMBEDDING_NORM = 3.0  # logit of a copied token ~ EMBEDDING_NORM * |h|: confident from the first step


@dataclass(frozen=True)
class TinyGptOssSpec:
    """Shape of the demo model. ``num_attention_heads * head_dim`` need not equal ``hidden_size``."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    sliding_window: int = 128

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TinyGptOssSpec.{name} must be a positive int, got {value!r}")
        if self.head_dim != 64:
            raise ValueError(f"head_dim must be 64 (vLLM's CPU attention supports no other size), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 2 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [2, num_local_experts={self.num_local_experts}], "
                f"got {self.num_experts_per_tok}"
            )


def tiny_config(tokenizer, spec: TinyGptOssSpec = TinyGptOssSpec()) -> GptOssConfig:
    """A ``GptOssConfig`` sized by ``spec`` over ``tokenizer``'s vocabulary, ending generation at
    ``<|return|>`` and ``<|call|>`` (as the released checkpoints do)."""
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in (RETURN, CALL)]
    return GptOssConfig(
        vocab_size=len(tokenizer),
        **asdict(spec),
        max_position_embeddings=131072,  # GPT-OSS's YaRN RoPE (factor 32 over 4096), which vLLM reads as is
        tie_word_embeddings=False,
        router_aux_loss_coef=0.0,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stop_ids,
        bos_token_id=tokenizer.bos_token_id,
    )


def build_tiny_gpt_oss(
    tokenizer, spec: TinyGptOssSpec = TinyGptOssSpec(), *, seed: int = 0, attn_implementation: str = "fa3_sink"
) -> GptOssForCausalLM:
    """A randomly initialised fp32 tiny GPT-OSS, a pure function of ``seed``."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_config(tokenizer, spec))
    generator = torch.Generator().manual_seed(seed)
    low, high = SINK_INIT_RANGE
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(torch.empty(sinks.shape).uniform_(low, high, generator=generator))
        _init_copy_prior(model)
    model.generation_config.eos_token_id = list(model.config.eos_token_id)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.set_attn_implementation(attn_implementation)
    return model


def _init_copy_prior(model: GptOssForCausalLM) -> None:
    """Unit-direction embeddings scaled to ``EMBEDDING_NORM``, ``lm_head`` = embeddings, identity value/output
    projections in the last layer (every head passes the attended tokens' embedding through unchanged)."""
    embedding = model.model.embed_tokens.weight
    norms = embedding.norm(dim=1, keepdim=True)
    embedding.copy_(torch.where(norms > 0, embedding / norms.clamp_min(1e-12) * EMBEDDING_NORM, embedding))
    model.lm_head.weight.copy_(embedding)
    attention = model.model.layers[-1].self_attn
    hidden, head_dim = model.config.hidden_size, attention.head_dim
    eye = torch.eye(hidden, head_dim)  # [hidden, head_dim]: the first min(hidden, head_dim) dimensions
    kv_heads = attention.v_proj.weight.shape[0] // head_dim
    q_heads = attention.o_proj.weight.shape[1] // head_dim
    attention.v_proj.weight.copy_(eye.T.repeat(kv_heads, 1))
    attention.v_proj.bias.zero_()
    attention.o_proj.weight.copy_(eye.repeat(1, q_heads) / q_heads)  # the mean over heads, not the sum


def save_checkpoint(model: GptOssForCausalLM, tokenizer, path) -> Path:
    """Save fp32 safetensors plus the tokenizer: a directory both transformers and ``vllm serve`` load."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
