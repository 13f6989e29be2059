"""GPT-OSS mixture of experts on plain torch: sort the (token, k) pairs once, run each expert on one contiguous
slice, hand-written backward. ``trl_gptoss.experts`` plugs it into transformers."""

from gptoss_kernels.experts.ops import sequential_experts
from gptoss_kernels.experts.params import ExpertParams
from gptoss_kernels.experts.swiglu import swiglu_clamped

__all__ = ["ExpertParams", "sequential_experts", "swiglu_clamped"]
