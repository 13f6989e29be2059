"""Transformers side of the memory-safe GPT-OSS experts (the op itself is ``gptoss_kernels.experts``).

``patch_gpt_oss_experts(model)`` swaps ``GptOssSequentialExperts`` in, reversibly; or pass
``experts_implementation="gptoss_sequential"`` (registered by ``import trl_gptoss``) to ``from_pretrained``.
Routing replay (R3) is ``trl_gptoss.experts.routing``, imported on demand: this package is imported whenever
transformers loads GPT-OSS (to register the experts), so it imports nothing it does not need for that.
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
