"""Sequence-parallel process groups: contiguous blocks of ``sp_size`` ranks inside the data-parallel world.

Ranks ``[i * sp, (i + 1) * sp)`` form group ``i`` (neighbouring ranks share a node, so the per-layer
all-to-alls stay on the fast interconnect). Gradients are still reduced over the whole world by DDP/FSDP2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class SequenceParallelGroup:
    """This rank's view of its SP group. ``group is None`` means a group of one (no collectives)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def single(cls) -> SequenceParallelGroup:
        return cls(group=None, rank=0, size=1)


def build_sequence_parallel_group(sp_size: int) -> SequenceParallelGroup:
    """Create every contiguous SP group (a collective: all ranks must call it) and return this rank's.

    A dedicated process group keeps the per-layer all-to-alls from interleaving with DDP/FSDP2 traffic.
    """
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive int, got {sp_size!r}")
    if sp_size == 1:
        return SequenceParallelGroup.single()
    if not dist.is_initialized():
        raise ValueError("sp_size > 1 needs torch.distributed to be initialised (launch with accelerate or torchrun)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sp_size:
        raise ValueError(f"sp_size={sp_size} must divide the world size {world}")
    mine = None
    for start in range(0, world, sp_size):
        ranks = list(range(start, start + sp_size))
        group = dist.new_group(ranks)  # every rank must create every group, in the same order
        if rank in ranks:
            mine = SequenceParallelGroup(group=group, rank=rank - start, size=sp_size)
    return mine
