"""Log-probs leave an FSDP2 mixed-precision model in the dtype they were computed in, not the compute dtype.

accelerate 1.15's ``set_mixed_precision("bf16")`` gives FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=bf16, output_dtype=bf16)`` (``accelerate/utils/dataclasses.py``, ``FullyShardedDataParallelPlugin``),
and ``output_dtype`` casts the floating outputs of every ``fully_shard`` module, the root included. The root's
outputs are the loss pass's per-token log-probs (``selective_logprobs`` computes them in fp32): cast to bf16 they
keep 8 bits, a resolution of 0.03 at a log-prob of -5, so the rollout-correction weights ``exp(logp - logp_vllm)``
and every train-inference mismatch metric would measure bf16 rounding instead of the mismatch. No accelerate YAML
key reaches ``output_dtype``; the trainer drops the cast before ``prepare`` (parameters still compute and reduce
in bf16: only outputs are left as computed, and each sharded layer casts its inputs to bf16 anyway).
"""

from __future__ import annotations

import dataclasses

import torch

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def keep_outputs_as_computed(accelerator) -> bool:
    """Set the FSDP2 plugin's ``output_dtype`` to ``None`` when it is a half type; ``True`` when it changed."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if getattr(plugin, "fsdp_version", 1) != 2 or getattr(policy, "output_dtype", None) not in _LOW_PRECISION:
        return False
    plugin.mixed_precision_policy = dataclasses.replace(policy, output_dtype=None)
    return True
