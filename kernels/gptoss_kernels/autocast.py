"""Sink attention under ``torch.autocast``: one rule for every public entry point.

Autocast runs attention in its lower-precision dtype (torch's ``scaled_dot_product_attention`` is on the
lower-precision list on CPU and CUDA), so the entry points cast fp32/fp16/bf16 ``q, k, v`` to the autocast
dtype of their device, as autocast does for SDPA; float64 is left alone, as autocast leaves it. The backends
then run exactly as they do for inputs of that dtype (fp32 accumulation, ``o`` in the input dtype), with
autocast switched off inside, forward and backward: their own fp32 matmuls must not be cast again (a
``bmm`` of an fp32 accumulator with an autocast-bf16 tile is a dtype error). Gradients of the cast inputs
come back in the caller's dtype through the autograd of the cast.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs lower-precision ops in on ``device``, or None when autocast is off there."""
    if not torch.amp.is_autocast_available(device.type) or not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def autocast_inputs(q, k, v):
    """``(q, k, v)`` cast to the autocast dtype of q's device when autocast is on there (fp32/fp16/bf16
    tensors only; anything else, float64 included, is returned as it is for validation to judge)."""
    if not isinstance(q, torch.Tensor):
        return q, k, v
    dtype = autocast_dtype(q.device)
    if dtype is None:
        return q, k, v
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _CASTABLE else t for t in (q, k, v))


def autocast_off(device: torch.device):
    """A context that switches autocast off on ``device`` (a no-op context when it is not on)."""
    if autocast_dtype(device) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def without_autocast(fn):
    """Decorate an autograd ``forward``/``backward``: run it with autocast off on the device of its first
    tensor argument (autograd runs a backward under the autocast state of the ``.backward()`` call)."""

    @functools.wraps(fn)
    def run(*args):
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if tensor is None:
            return fn(*args)
        with autocast_off(tensor.device):
            return fn(*args)

    return run
