"""Layer checkpoints in host memory: each checkpointed decoder layer's input leaves the device after the
layer's forward and comes back one layer ahead of the layer's backward.

One object owns the timeline (``CheckpointOffload``): per forward, a chain of records (one per layer, each
linked to the layer before); in backward, the hook on layer ``i``'s output (it fires when that gradient is
complete, i.e. before layer ``i``'s recompute) waits for layer ``i``'s input, starts bringing back layer
``i - 1``'s, after releasing layer ``i + 1``'s (its backward is done). The device therefore holds at most two
layer inputs at a time instead of one per layer.

The input tensor object stays where autograd's checkpoint keeps it; only its storage moves: the bytes are
copied to a host buffer and the storage is resized to 0, then resized back and refilled before the recompute
(``UntypedStorage`` copies: no version-counter bump, so the checkpoint sees the same tensor). On CUDA the
copies run on a side stream (pinned host buffers, ``non_blocking``), ordered by events; on the CPU the same
code path runs with synchronous copies. A layer input whose storage it does not own alone (a view of a larger
buffer) stays on the device (``kept_on_device`` counts them).

One backward per forward: after the backward the inputs' storages are released, so ``retain_graph=True`` with
a second backward is not supported (the trainer's loss pass runs one). Nor is ``output_hidden_states=True`` in
a forward with grad: the recorded layer outputs are the next layers' inputs, whose storage leaves the device
until their layer's backward (the trainer's loss pass reads only the last hidden state).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class OffloadedInput:
    """One layer's input in host memory: the device tensor (storage resized to 0 while away), its host copy,
    the CUDA event its last copy recorded (None on the CPU), the record of the layer before in this forward."""

    tensor: torch.Tensor
    host: torch.Tensor
    previous: OffloadedInput | None
    output: weakref.ref
    copied: torch.cuda.Event | None = None
    on_device: bool = True


def owns_its_storage(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is its storage's only contents (freeing the storage frees nothing else)."""
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


class CheckpointOffload:
    """The offload timeline of one model's checkpointed layers (see the module docstring).

    ``wrap(checkpoint_fn)`` returns the checkpoint function a decoder layer calls
    (``checkpoint_fn(function, hidden_states, ...)``) with the offload around it. Counters for tests and
    benchmarks: ``offloaded`` (inputs sent to the host), ``kept_on_device``, ``peak_device_inputs`` (most layer
    inputs resident on the device at once during a backward) and ``device_input_bytes`` (bytes resident now).
    """

    def __init__(self):
        self._last: OffloadedInput | None = None
        self._host_pool: dict[tuple, list[torch.Tensor]] = {}
        self._stream = None
        self.offloaded = self.kept_on_device = self.peak_device_inputs = 0
        self._resident: set[OffloadedInput] = set()

    def wrap(self, checkpoint_fn: Callable) -> Callable:
        def checkpoint_with_offload(function, hidden_states, *args, **kwargs):
            output = checkpoint_fn(function, hidden_states, *args, **kwargs)
            self._after_forward(hidden_states, output)
            return output

        checkpoint_with_offload.offload = self
        return checkpoint_with_offload

    @property
    def device_input_bytes(self) -> int:
        """Bytes of offloaded layer inputs resident on the device now (this forward's chain and any brought
        back): 0 between a forward and its backward."""
        records, node = set(self._resident), self._last
        while node is not None:
            records.add(node)
            node = node.previous
        return sum(r.tensor.untyped_storage().nbytes() for r in records)

    # -- forward --------------------------------------------------------------------------------------------
    def _after_forward(self, hidden_states, output) -> None:
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
            return  # no backward will come for this layer
        if not owns_its_storage(hidden_states):
            self.kept_on_device += 1
            return
        last = self._last
        previous = last if last is not None and last.output() is hidden_states else None
        record = OffloadedInput(hidden_states, self._host_buffer(hidden_states), previous, weakref.ref(output))
        self._copy(record, to_host=True)
        hidden_states.untyped_storage().resize_(0)
        record.on_device = False
        self._last = record
        self.offloaded += 1
        output.register_hook(self._backward_hook(record))

    def _host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        key = (tuple(tensor.shape), tensor.dtype)
        free = self._host_pool.get(key)
        if free:
            return free.pop()
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)

    # -- backward -------------------------------------------------------------------------------------------
    def _backward_hook(self, record: OffloadedInput):
        def before_layer_backward(grad):
            self._release_after(record)  # first: the next layer's input is done, its bytes can be reused
            self._bring_back(record)
            self._wait(record)
            if record.previous is not None:
                self._bring_back(record.previous)  # one layer ahead, overlapping this layer's backward
            self.peak_device_inputs = max(self.peak_device_inputs, len(self._resident))
            if record.previous is None:  # the first layer: from here autograd alone keeps its input
                self._forget(record)
            return grad

        return before_layer_backward

    def _bring_back(self, record: OffloadedInput) -> None:
        if record.on_device:
            return
        storage = record.tensor.untyped_storage()
        storage.resize_(record.host.untyped_storage().nbytes())
        self._copy(record, to_host=False)
        record.on_device = True
        self._resident.add(record)

    def _release_after(self, record: OffloadedInput) -> None:
        """Free the inputs of the layers after ``record``'s: their backward is complete."""
        for later in [r for r in self._resident if _is_after(r, record)]:
            later.tensor.untyped_storage().resize_(0)
            self._resident.discard(later)
            self._return_host(later)

    def _forget(self, record: OffloadedInput) -> None:
        """Stop tracking the chain that ends at ``record`` (the first layer's input, back on the device)."""
        self._resident.discard(record)
        self._return_host(record)
        if self._last is not None and (self._last is record or _is_after(self._last, record)):
            self._last = None

    def _return_host(self, record: OffloadedInput) -> None:
        key = (tuple(record.host.shape), record.host.dtype)
        self._host_pool.setdefault(key, []).append(record.host)

    # -- copies ---------------------------------------------------------------------------------------------
    def _copy(self, record: OffloadedInput, *, to_host: bool) -> None:
        source, target = (record.tensor, record.host) if to_host else (record.host, record.tensor)
        if not record.tensor.is_cuda:
            target.untyped_storage().copy_(source.untyped_storage())
            return
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())  # the data (or the new allocation) is ready
        with torch.cuda.stream(stream):
            target.untyped_storage().copy_(source.untyped_storage(), non_blocking=True)
            record.copied = torch.cuda.Event()
            record.copied.record(stream)
        if to_host:
            record.tensor.record_stream(stream)  # the allocator waits for the copy before reusing the bytes

    def _wait(self, record: OffloadedInput) -> None:
        if record.copied is not None:
            torch.cuda.current_stream().wait_event(record.copied)

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream


def _is_after(candidate: OffloadedInput, record: OffloadedInput) -> bool:
    """True when ``candidate`` belongs to a later layer than ``record`` in the same forward."""
    node = candidate.previous
    while node is not None:
        if node is record:
            return True
        node = node.previous
    return False
