"""Configuration of sink-aware Ulysses context parallelism.

accelerate 1.15 cannot carry this setting (its ``sp_backend`` accepts only ``"deepspeed"`` and unknown nested
YAML keys are dropped), so the plugin is a dataclass of its own that can also be filled from environment
variables. ``accelerate launch`` forwards the launcher's environment to every worker, so

    TRL_GPTOSS_SP_SIZE=4 accelerate launch --config_file examples/configs/accelerate_context_parallel.yaml ...

turns context parallelism on without code changes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from trl_gptoss import FA3_SINK

ENV_PREFIX = "TRL_GPTOSS_SP_"

# Inner attentions that honour GPT-OSS sinks. "eager" is the GPT-OSS module's own eager attention (it reads
# ``module.sinks``); "fa3_sink" is this package's kernel (it reads ``s_aux``). sdpa/flash/flex variants of
# transformers either ignore ``s_aux`` or cannot take a sliced one, so they are refused.
SINK_AWARE_INNER_ATTENTIONS = ("eager", FA3_SINK)


@dataclass
class ContextParallelPlugin:
    """Sink-aware Ulysses (all-to-all) context parallelism for GPT-OSS.

    ``sp_size`` consecutive ranks form one sequence-parallel group inside the data-parallel world: the group
    runs each member's micro-batch in turn, sharded along the sequence ("SP over DP"), so accelerate, the
    sampler and the loss keep seeing plain data parallelism.
    """

    sp_size: int = field(default=1, metadata={"help": "Ranks that share one sequence (1 disables SP)."})
    inner_attention: str = field(
        default="eager",
        metadata={"help": f"Attention run on the gathered sequence, one of {SINK_AWARE_INNER_ATTENTIONS}."},
    )

    def __post_init__(self):
        if not isinstance(self.sp_size, int) or isinstance(self.sp_size, bool) or self.sp_size < 1:
            raise ValueError(f"sp_size must be a positive int, got {self.sp_size!r}")
        if self.inner_attention not in SINK_AWARE_INNER_ATTENTIONS:
            raise ValueError(
                f"inner_attention={self.inner_attention!r} cannot take per-head sinks; use one of "
                f"{SINK_AWARE_INNER_ATTENTIONS}"
            )

    @property
    def enabled(self) -> bool:
        return self.sp_size > 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> ContextParallelPlugin:
        """Build from ``TRL_GPTOSS_SP_<FIELD>`` variables (``TRL_GPTOSS_SP_SIZE``, ...); keywords win."""
        environ = os.environ if environ is None else environ
        values = {}
        for spec in fields(cls):
            key = ENV_PREFIX + ("SIZE" if spec.name == "sp_size" else spec.name.upper())
            if key in environ and spec.name not in overrides:
                values[spec.name] = _parse_env_value(key, environ[key], spec.default)
        return cls(**values, **overrides)

    def check_world(self, world_size: int) -> None:
        """Raise before any collective when ``sp_size`` cannot tile the world into contiguous groups."""
        if world_size % self.sp_size:
            raise ValueError(
                f"sp_size={self.sp_size} must divide the number of processes ({world_size}); "
                f"choose an sp_size among {[d for d in range(1, world_size + 1) if world_size % d == 0]}"
            )

    def check_model(self, config) -> None:
        """Raise when the model's heads cannot be split over ``sp_size`` ranks.

        Query heads are split evenly; KV heads are split when ``sp_size <= Hkv`` (needs ``Hkv % sp == 0``) and
        replicated when ``sp_size > Hkv`` (needs ``sp % Hkv == 0``: a rank's query heads share one KV head).
        """
        hq, hkv = config.num_attention_heads, config.num_key_value_heads
        if hq % self.sp_size:
            raise ValueError(
                f"sp_size={self.sp_size} must divide num_attention_heads={hq}: each rank takes Hq/sp heads"
            )
        if hkv % self.sp_size and self.sp_size % hkv:
            raise ValueError(
                f"sp_size={self.sp_size} and num_key_value_heads={hkv} must divide one another "
                "(KV heads are split when sp <= Hkv and replicated when sp > Hkv)"
            )


def _parse_env_value(key: str, raw: str, default):
    if isinstance(default, bool):
        lowered = raw.strip().lower()
        if lowered not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"{key}={raw!r} must be one of 1/0/true/false/yes/no")
        return lowered in ("1", "true", "yes")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{key}={raw!r} must be an integer") from None
    return raw.strip()
