"""gptoss_kernels: attention with learnable sinks and MoE math for GPT-OSS (torch; Triton when present)."""

from gptoss_kernels.attention import BACKENDS, select_backend, sink_attention
from gptoss_kernels.chunked import RowIntervals, row_intervals, sink_attention_chunked, sink_attention_intervals
from gptoss_kernels.experts import ExpertParams, sequential_experts
from gptoss_kernels.logprobs import selective_logprobs, selective_logprobs_ref
from gptoss_kernels.reference import sink_attention_ref
from gptoss_kernels.validation import check_sink_attention_inputs

__all__ = [
    "BACKENDS",
    "ExpertParams",
    "RowIntervals",
    "check_sink_attention_inputs",
    "row_intervals",
    "select_backend",
    "selective_logprobs",
    "selective_logprobs_ref",
    "sequential_experts",
    "sink_attention",
    "sink_attention_chunked",
    "sink_attention_intervals",
    "sink_attention_ref",
]
