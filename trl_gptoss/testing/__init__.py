"""Offline fixtures: tiny GPT-OSS models, Harmony tokenizers and a real vLLM rollout server for tests."""

from trl_gptoss.testing.models import save_tiny_checkpoint, tiny_gpt_oss, tiny_gpt_oss_config

__all__ = ["save_tiny_checkpoint", "tiny_gpt_oss", "tiny_gpt_oss_config"]
