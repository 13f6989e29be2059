"""Sink-aware Ulysses context parallelism for GPT-OSS on accelerate (DDP / FSDP2).

plugin = ContextParallelPlugin.from_env()          # or ContextParallelPlugin(sp_size=4)
runner = prepare_context_parallel(accelerator, model, plugin)
result = runner.forward_backward(input_ids, attention_mask, loss_fn)
# per-token values through selective_logprobs: prepare_context_parallel(..., head=HeadConfig(temperature=0.7))
"""

from trl_gptoss.parallel.attention import (
    register_ulysses_attention,
    sharded_forward,
    ulysses_attention_forward,
)
from trl_gptoss.parallel.batching import PackedRows, pack_rows, token_log_probs, unpack_token_values
from trl_gptoss.parallel.config import ContextParallelPlugin
from trl_gptoss.parallel.engine import ContextParallelRunner, StepResult, prepare_context_parallel
from trl_gptoss.parallel.groups import SequenceParallelGroup, build_sequence_parallel_group
from trl_gptoss.parallel.head import HeadConfig

__all__ = [
    "ContextParallelPlugin",
    "ContextParallelRunner",
    "HeadConfig",
    "PackedRows",
    "SequenceParallelGroup",
    "StepResult",
    "build_sequence_parallel_group",
    "pack_rows",
    "prepare_context_parallel",
    "register_ulysses_attention",
    "sharded_forward",
    "token_log_probs",
    "ulysses_attention_forward",
    "unpack_token_values",
]
