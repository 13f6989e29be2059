"""GRPO for GPT-OSS on TRL: ``GptOssGRPOConfig``, ``GptOssGRPOTrainer`` and the rollout-correction math."""

from trl_gptoss.trainer.config import ROLLOUT_BACKENDS, GptOssGRPOConfig
from trl_gptoss.trainer.correction import (
    PRESETS,
    Correction,
    CorrectionPreset,
    CorrectionThresholds,
    finalize_metrics,
    masked_log_ratio,
    mismatch_stats,
    rollout_correction,
)
from trl_gptoss.trainer.trainer import GptOssGRPOTrainer

__all__ = [
    "PRESETS",
    "ROLLOUT_BACKENDS",
    "Correction",
    "CorrectionPreset",
    "CorrectionThresholds",
    "GptOssGRPOConfig",
    "GptOssGRPOTrainer",
    "finalize_metrics",
    "masked_log_ratio",
    "mismatch_stats",
    "rollout_correction",
]
