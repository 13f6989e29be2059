"""The sampling timeline of a GRPO run: which weights sample each batch, and when a push may land (``Sampler``)."""

from trl_gptoss.trainer.sampling.engines import ENGINE_KINDS, EngineKind
from trl_gptoss.trainer.sampling.sampler import SampledBatch, Sampler

__all__ = ["ENGINE_KINDS", "EngineKind", "SampledBatch", "Sampler"]
