"""Collectives with a name and a deadline: when the ranks do not all join, each ends with an error that names
the collective it waited in, instead of blocking until the process group's own timeout says nothing useful.

Every rank must call the same collectives in the same order; a rank that skips one (or calls another) leaves
its peers waiting. The operation runs asynchronously and is waited for with ``timeout_s`` (``Work.wait``, on
gloo and NCCL alike); on expiry the error says which collective, on which rank, and how long it waited.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist


class CollectiveTimeout(RuntimeError):
    """A named collective did not complete on this rank within its deadline."""


def all_gather_object(obj, *, name: str, timeout_s: float, group=None) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank of ``group`` (default: the world);
    ``name`` says what is gathered."""
    world = dist.get_world_size(group)
    device = _device()
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    _wait(dist.all_gather(sizes, size, group=group, async_op=True), f"{name} (sizes)", timeout_s)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in range(world)]
    _wait(dist.all_gather(gathered, padded, group=group, async_op=True), name, timeout_s)
    return [pickle.loads(t[: int(s.item())].cpu().numpy().tobytes()) for t, s in zip(gathered, sizes)]


def broadcast_object(obj, *, src: int, name: str, timeout_s: float, group=None):
    """``src``'s ``obj`` (picklable) on every rank of ``group``; ``name`` says what is shared. Every rank passes
    something (ignored off ``src``)."""
    return all_gather_object(obj if dist.get_rank() == src else None, name=name, timeout_s=timeout_s, group=group)[src]


def _device() -> torch.device:
    """Where the backend communicates: NCCL needs the rank's CUDA device, gloo takes CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(work, name: str, timeout_s: float) -> None:
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as error:
        raise CollectiveTimeout(
            f"rank {dist.get_rank()} of {dist.get_world_size()}: the collective {name!r} did not complete within "
            f"{timeout_s:.0f} s -- another rank did not join it (it failed, or called a different collective). "
            f"The backend said: {error}"
        ) from error
