"""Rollouts: engines behind one async ``generate`` and the multi-turn Harmony tool loop ``run_rollouts``."""

from trl_gptoss.rollout.config import RolloutConfig
from trl_gptoss.rollout.loop import arun_rollouts, run_rollouts
from trl_gptoss.rollout.server import VLLMServer
from trl_gptoss.rollout.transformers_engine import TransformersEngine
from trl_gptoss.rollout.types import (
    FinishReason,
    Generation,
    GenerationRequest,
    Rollout,
    RolloutEngine,
    StopReason,
)
from trl_gptoss.rollout.vllm_engine import VLLMServerEngine, VLLMServerError
from trl_gptoss.rollout.weights import push_tensors

__all__ = [
    "FinishReason",
    "Generation",
    "GenerationRequest",
    "Rollout",
    "RolloutConfig",
    "RolloutEngine",
    "StopReason",
    "TransformersEngine",
    "VLLMServer",
    "VLLMServerEngine",
    "VLLMServerError",
    "arun_rollouts",
    "push_tensors",
    "run_rollouts",
]
