"""TRL ``GRPOConfig`` fields that ``GptOssGRPOTrainer`` cannot honour: set to anything but TRL's default, refused.

Generation runs in trl-gptoss engines (``rollout_backend``), not TRL's, so TRL's sampling extras and its own
vLLM / transformers-generation settings would be read by nobody: a run that set them would not do what its
YAML says.
"""

from __future__ import annotations

import dataclasses

from trl import GRPOConfig

_SAMPLING = "the rollout engines sample with temperature, top_p and top_k only"
_VLLM = (
    "TRL's vLLM integration is not used: point rollout_server_url at `trl-gptoss vllm-serve` servers, or let the "
    "trainer start one (rollout_max_model_len, rollout_server_timeout)"
)
_TRANSFORMERS_GEN = "in-process generation is rollout_backend='transformers'"

# field -> why it cannot be honoured and what to use instead
REFUSED = {
    "min_p": _SAMPLING,
    "repetition_penalty": _SAMPLING,
    "generation_kwargs": _SAMPLING,
    "chat_template_kwargs": "prompts are rendered in Harmony by trl_gptoss.harmony (pass rollout_system to the "
    "trainer for the system message)",
    "cache_implementation": _TRANSFORMERS_GEN,
    "use_transformers_continuous_batching": _TRANSFORMERS_GEN,
    "transformers_continuous_batching_config": _TRANSFORMERS_GEN,
    "use_transformers_paged": _TRANSFORMERS_GEN,
    "vllm_mode": _VLLM,
    "vllm_model_impl": _VLLM,
    "vllm_enable_sleep_mode": _VLLM,
    "vllm_structured_outputs_regex": _VLLM,
    "vllm_server_base_url": _VLLM,
    "vllm_server_host": _VLLM,
    "vllm_server_port": _VLLM,
    "vllm_server_timeout": _VLLM,
    "vllm_group_port": _VLLM,
    "vllm_gpu_memory_utilization": _VLLM,
    "vllm_max_model_length": _VLLM,
    "vllm_tensor_parallel_size": _VLLM,
}


def _trl_default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


_TRL_DEFAULTS = {f.name: _trl_default(f) for f in dataclasses.fields(GRPOConfig) if f.name in REFUSED}


def refused_parent_fields(config) -> list[str]:
    """One line per refused TRL field that ``config`` sets to a non-default value."""
    return [
        f"{name}={getattr(config, name)!r}: {why}"
        for name, why in REFUSED.items()
        if getattr(config, name) != _TRL_DEFAULTS[name]
    ]
