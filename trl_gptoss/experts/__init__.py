"""Transformers side of the memory-safe GPT-OSS experts (the op itself is ``gptoss_kernels.experts``).

``patch_gpt_oss_experts(model)`` swaps ``GptOssSequentialExperts`` in, reversibly; or pass
``experts_implementation="gptoss_sequential"`` (registered by ``import trl_gptoss``) to ``from_pretrained``.
"""

from trl_gptoss import SEQUENTIAL_EXPERTS
from trl_gptoss.experts.module import (
    ExpertsPatch,
    GptOssSequentialExperts,
    patch_gpt_oss_experts,
    register_sequential_experts,
)

__all__ = [
    "SEQUENTIAL_EXPERTS",
    "ExpertsPatch",
    "GptOssSequentialExperts",
    "patch_gpt_oss_experts",
    "register_sequential_experts",
]
