"""Triton sink-attention kernels (forward and backward), FlashAttention-2 tiling, packed varlen layout.

Set ``TRITON_INTERPRET=1`` before importing this package to run them on CPU tensors (tests); on CUDA they run
natively. The package's public dispatch (``gptoss_kernels.sink_attention``) imports this lazily.
"""

from gptoss_kernels.triton.function import SinkAttentionTritonFunction, sink_attention_triton

__all__ = ["SinkAttentionTritonFunction", "sink_attention_triton"]
