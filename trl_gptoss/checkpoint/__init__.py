"""Checkpoint conversion: MXFP4 GPT-OSS hub checkpoints -> bfloat16 checkpoints the trainer and vLLM load.

``convert_checkpoint(src, dst, dtype="bfloat16")`` (the ``trl-gptoss convert`` command) streams one shard at a
time; ``dequantize_mxfp4`` is the exact math on one expert projection.
"""

from trl_gptoss.checkpoint.convert import DTYPES, ConversionResult, convert_checkpoint
from trl_gptoss.checkpoint.mxfp4 import E2M1_VALUES, MXFP4FormatError, dequantize_mxfp4
from trl_gptoss.checkpoint.safetensors_files import CheckpointError

__all__ = [
    "DTYPES",
    "E2M1_VALUES",
    "CheckpointError",
    "ConversionResult",
    "MXFP4FormatError",
    "convert_checkpoint",
    "dequantize_mxfp4",
]
