"""Which dtype each part of the experts op runs in, with and without ``torch.autocast``.

Stock ``GptOssExperts`` under autocast (fp32 weights, ``bf16: true``) runs its two matmuls in the autocast
dtype -- autocast casts ``x`` and ``W[e]`` per call -- while the bias adds, the gate, the routing-weight
product and the ``[T, H]`` accumulation follow type promotion in the wider dtype of ``hidden_states``. The op
reproduces exactly that split, explicitly (it runs with autocast switched off, so nothing is cast twice and
``out=`` matmuls stay legal):

- ``io``: the input and the ``[T, H]`` output: ``hidden_states``' dtype;
- ``mm``: matmul operands: the autocast dtype while autocast is on for the tensors' device, else ``io``
  (float64 is never lowered, as autocast leaves it alone);
- ``act``: each slice's pre-activations (saved for backward), expert outputs, bias adds and routing weights:
  the promotion of ``mm`` and ``io``, as stock's ``x @ W[e] + b[e]`` promotes (``io`` but for fp16 autocast
  over bf16 weights, where it is fp32);
- ``math``: the gate's elementwise math and ``d_hidden``'s accumulation: fp32 for half ``act``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gptoss_kernels.autocast import autocast_dtype
from gptoss_kernels.experts.swiglu import math_dtype_for


class Precision(NamedTuple):
    io: torch.dtype
    mm: torch.dtype
    act: torch.dtype
    math: torch.dtype

    @property
    def autocast(self) -> bool:
        """The matmuls run in another dtype than the activations (autocast lowered them)."""
        return self.mm != self.act


def precision_for(hidden_states: torch.Tensor) -> Precision:
    """The op's dtypes for these activations under the current autocast state."""
    io = hidden_states.dtype
    lowered = autocast_dtype(hidden_states.device)
    mm = lowered if lowered is not None and io != torch.float64 else io
    act = torch.promote_types(mm, io)
    return Precision(io=io, mm=mm, act=act, math=math_dtype_for(act))


def as_mm(tensor: torch.Tensor, precision: Precision) -> torch.Tensor:
    """``tensor`` as a matmul operand: a lowered copy under autocast, ``tensor`` itself otherwise."""
    return tensor.to(precision.mm)


def as_act(tensor: torch.Tensor, precision: Precision) -> torch.Tensor:
    """``tensor`` in the activations' dtype (biases and routing weights of another dtype under autocast)."""
    return tensor.to(precision.act)
