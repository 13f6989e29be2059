"""Memory-safe GPT-OSS experts: sort the (token, k) pairs once, run each expert on one contiguous slice.

Importing this package registers ``experts_implementation="gptoss_sequential"`` with transformers.
"""

from trl_gptoss.experts.module import (
    DEFAULT_ROWS_PER_CHUNK,
    SEQUENTIAL_EXPERTS,
    ExpertsPatch,
    GptOssSequentialExperts,
    patch_gpt_oss_experts,
    register_sequential_experts,
    sequential_experts_forward,
)
from trl_gptoss.experts.ops import (
    sequential_experts,
    swiglu_clamped,
    swiglu_clamped_backward,
    swiglu_clamped_with_grad,
)
from trl_gptoss.experts.plan import ExpertPlan, build_expert_plan, check_experts_inputs

register_sequential_experts()

__all__ = [
    "DEFAULT_ROWS_PER_CHUNK",
    "SEQUENTIAL_EXPERTS",
    "ExpertPlan",
    "ExpertsPatch",
    "GptOssSequentialExperts",
    "build_expert_plan",
    "check_experts_inputs",
    "patch_gpt_oss_experts",
    "register_sequential_experts",
    "sequential_experts",
    "sequential_experts_forward",
    "swiglu_clamped",
    "swiglu_clamped_backward",
    "swiglu_clamped_with_grad",
]
