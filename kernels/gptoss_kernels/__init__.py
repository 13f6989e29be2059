"""gptoss_kernels: attention with learnable sinks and MoE math for GPT-OSS (torch; Triton when present)."""

from gptoss_kernels.reference import sink_attention_ref
from gptoss_kernels.validation import check_sink_attention_inputs

__all__ = ["check_sink_attention_inputs", "sink_attention_ref"]
