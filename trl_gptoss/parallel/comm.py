"""Autograd-aware collectives over a sequence-parallel group (gloo and NCCL alike).

All-to-alls move whole chunks along dim 0 of a contiguous tensor: chunk ``j`` goes to group rank ``j`` and
the chunk received from rank ``j`` lands at index ``j``. That exchange is its own adjoint, so its backward is
the same all-to-all applied to the gradient. ``.contiguous()`` is taken before every exchange because c10d
writes contiguously whatever the strides of the output (a permuted ``empty_like`` scrambles silently).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trl_gptoss.parallel.groups import SequenceParallelGroup


def _exchange_dim0(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAllDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange_dim0(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """``[B, H, T/n, D]`` (all heads, my sequence slice) -> ``[B, H/n, T, D]`` (my heads, all tokens).

    Rank ``r`` receives heads ``[r*H/n, (r+1)*H/n)``; the gathered sequence is ordered by group rank.
    """
    n = sp.size
    if n == 1:
        return x
    b, h, t, d = x.shape
    if h % n:
        raise ValueError(f"{h} heads cannot be split over {n} ranks")
    chunks = x.reshape(b, n, h // n, t, d).permute(1, 0, 2, 3, 4)  # [n, B, H/n, T/n, D]
    received = _AllToAllDim0.apply(chunks, sp.group)  # index j = sequence slice of rank j
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def heads_to_seq(y: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """``[B, T, H/n, D]`` (my heads, all tokens) -> ``[B, T/n, H, D]`` (all heads, my sequence slice)."""
    n = sp.size
    if n == 1:
        return y
    b, t_total, h_local, d = y.shape
    if t_total % n:
        raise ValueError(f"sequence length {t_total} is not a multiple of the SP size {n}")
    t = t_total // n
    chunks = y.reshape(b, n, t, h_local, d).permute(1, 0, 2, 3, 4)  # [n, B, T/n, H/n, D]
    received = _AllToAllDim0.apply(chunks, sp.group)  # index j = heads of rank j
    return received.permute(1, 2, 0, 3, 4).reshape(b, t, n * h_local, d)


def _all_gather_dim0(x: torch.Tensor, group, size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class _GatherDim0(torch.autograd.Function):
    """Forward: concatenate every rank's slice. Backward: sum the gradient over ranks, keep my slice.

    The sum is what makes a loss computed on ONE rank (the owner) reach the slices held by the others.
    """

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.rank, ctx.size, ctx.length = group, rank, size, x.shape[0]
        return _all_gather_dim0(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.length : (ctx.rank + 1) * ctx.length], None, None, None


def gather_sequence(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """Differentiable all-gather along dim 0: ``[N/n, ...]`` per rank -> ``[N, ...]`` ordered by rank."""
    if sp.size == 1:
        return x
    return _GatherDim0.apply(x, sp.group, sp.rank, sp.size)


@torch.no_grad()
def gather_sequence_no_grad(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """All-gather along dim 0 for integer metadata (positions, labels); equal shapes on every rank."""
    if sp.size == 1:
        return x
    return _all_gather_dim0(x, sp.group, sp.size)


@torch.no_grad()
def gather_lengths(length: int, sp: SequenceParallelGroup) -> list[int]:
    """Every member's ``length`` (the owner loop needs the other members' packed sizes)."""
    if sp.size == 1:
        return [length]
    return gather_sequence_no_grad(torch.tensor([length], dtype=torch.int64), sp).tolist()
