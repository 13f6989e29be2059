"""Results computed from a small tensor's values (a validated ``cu_seqlens``, a padding layout), remembered
per tensor object so that the layers of one forward pass, which all receive the same object, read its values
back from the device once.

An entry is served only to the very object it was built from (a weak reference: a new tensor that reuses a
freed one's address is a miss) and only while its values are unchanged:

- an ordinary tensor carries a version counter that every in-place write bumps: the entry keeps the version
  it was built at, and the check reads nothing from the device;
- an inference tensor (created under ``torch.inference_mode``, as transformers' pipelines and ``generate``
  create masks and position ids) has no version counter and may still be written in place inside inference
  mode: the entry keeps a device copy of the values and the check compares them (``torch.equal``; on CUDA one
  small device read per hit).
"""

from __future__ import annotations

import weakref

import torch


def _stamp(tensor: torch.Tensor):
    """What identifies the tensor's current values: its version, or a copy of an inference tensor."""
    if tensor.is_inference():
        return ("values", tensor.detach().clone())
    return ("version", tensor._version)


def _unchanged(tensor: torch.Tensor, stamp) -> bool:
    kind, value = stamp
    if kind == "version":
        return not tensor.is_inference() and tensor._version == value
    return tensor.is_inference() and value.shape == tensor.shape and torch.equal(tensor, value)


class TensorCache:
    """The last ``size`` results of ``build()``, keyed by ``(tensor object, its values, extra)``.

    ``extra`` is any hashable key of the other arguments the result depends on (shapes, device, window).
    """

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: list[tuple] = []

    def get(self, tensor: torch.Tensor, extra, build):
        """``build()``'s result for this tensor's current values, built once (outside inference mode, so that
        tensors it creates can be saved for backward by a later training call) and then remembered."""
        for ref, stamp, key, value in self._entries:
            if ref() is tensor and key == extra and _unchanged(tensor, stamp):
                return value
        with torch.inference_mode(False):  # a result built under inference mode serves training calls too
            value = build()
        self._entries = [(weakref.ref(tensor), _stamp(tensor), extra, value), *self._entries[: self.size - 1]]
        return value

    def clear(self) -> None:
        self._entries = []
