"""Offline fixtures: tiny GPT-OSS models, Harmony tokenizers and a real vLLM rollout server for tests."""

from trl_gptoss.testing.models import save_tiny_checkpoint, tiny_gpt_oss, tiny_gpt_oss_config
from trl_gptoss.testing.tokenizers import harmony_tokenizer, use_offline_harmony_vocab  # re-exported runtime code
from trl_gptoss.testing.vllm_server import Completion, VLLMServer, vllm_python, vllm_server

__all__ = [
    "Completion",
    "VLLMServer",
    "harmony_tokenizer",
    "save_tiny_checkpoint",
    "tiny_gpt_oss",
    "tiny_gpt_oss_config",
    "use_offline_harmony_vocab",
    "vllm_python",
    "vllm_server",
]
