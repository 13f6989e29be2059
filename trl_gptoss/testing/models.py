"""Tiny, offline GPT-OSS models for tests, examples and benchmarks.

The shapes keep what matters for correctness (head_dim 64 as vLLM's CPU backend requires, GQA,
alternating sliding/full layers, >= 2 experts per token, sinks) and shrink everything else.
Sinks are drawn from U(-1, 3): large enough that attention which ignores them is visibly wrong.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GptOssConfig, GptOssForCausalLM

_TINY_DEFAULTS = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=32,
    # GPT-OSS's own yarn RoPE (factor 32 over 4096 positions) is kept: vLLM's GPT-OSS reads its yarn fields.
    max_position_embeddings=131072,
    tie_word_embeddings=False,
)

SINK_INIT_RANGE = (-1.0, 3.0)


def _check_positive(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def tiny_gpt_oss_config(**overrides) -> GptOssConfig:
    """A ``GptOssConfig`` for a ~1M-parameter model; any ``GptOssConfig`` field may be overridden."""
    fields = {**_TINY_DEFAULTS, **overrides}
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_local_experts",
        "num_experts_per_tok",
    ):
        _check_positive(name, fields[name])
    if fields["vocab_size"] < 512:
        raise ValueError(f"vocab_size must be >= 512 to hold the small Harmony tokenizer, got {fields['vocab_size']}")
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise ValueError(
            f"num_attention_heads ({fields['num_attention_heads']}) must be a multiple of "
            f"num_key_value_heads ({fields['num_key_value_heads']})"
        )
    if not 2 <= fields["num_experts_per_tok"] <= fields["num_local_experts"]:
        raise ValueError(
            f"num_experts_per_tok must be in [2, num_local_experts={fields['num_local_experts']}], "
            f"got {fields['num_experts_per_tok']}"
        )
    if fields["sliding_window"] is not None:
        _check_positive("sliding_window", fields["sliding_window"])
    return GptOssConfig(**fields)


def _init_sinks(model, generator):
    low, high = SINK_INIT_RANGE
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                param.copy_(torch.empty(param.shape).uniform_(low, high, generator=generator))


def tiny_gpt_oss(
    config: GptOssConfig | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    **overrides,
) -> GptOssForCausalLM:
    """A randomly initialised tiny ``GptOssForCausalLM`` (deterministic for a given ``seed``)."""
    if config is not None and overrides:
        raise ValueError("pass either config or field overrides, not both")
    if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    config = config or tiny_gpt_oss_config(**overrides)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config)
    _init_sinks(model, generator)
    model.set_attn_implementation(attn_implementation)
    return model.to(dtype).eval()


def save_tiny_checkpoint(
    path, model: GptOssForCausalLM | None = None, *, tokenizer=None, seed: int = 0, **overrides
) -> Path:
    """Save a tiny model (fp32, safetensors) plus a tokenizer as a directory ``vllm serve`` can load."""
    from trl_gptoss.testing.tokenizers import harmony_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = model if model is not None else tiny_gpt_oss(seed=seed, **overrides)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    (tokenizer or harmony_tokenizer(small=True)).save_pretrained(path)
    return path
