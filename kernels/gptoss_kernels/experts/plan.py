"""The sort-once routing plan shared by the forward and backward loops."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlan:
    """Where each (token, k) pair goes, sorted by expert.

    order: int64 ``[S]`` (S = T*K), a stable argsort of the flattened ``router_indices``, so the pairs of one
    expert form the contiguous slice ``order[start:end]``. token_of_pair: int64 ``[S]``, ``order // K`` (the
    token row of each sorted pair). segments: ``(expert, start, end)`` slices of at most ``rows_per_chunk``
    rows, experts without tokens omitted.
    """

    order: torch.Tensor
    token_of_pair: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    num_pairs: int


def _split(expert: int, start: int, end: int, rows_per_chunk: int | None) -> list[tuple[int, int, int]]:
    if end == start:  # an expert without tokens costs nothing
        return []
    step = end - start if rows_per_chunk is None else rows_per_chunk
    return [(expert, lo, min(lo + step, end)) for lo in range(start, end, step)]


def build_expert_plan(
    router_indices: torch.Tensor,
    routing_weights: torch.Tensor,
    num_experts: int,
    *,
    rows_per_chunk: int | None = None,
    layer_name: str = "experts",
) -> ExpertPlan:
    """Sort the flattened assignments ``router_indices [T, K]`` once.

    One host sync fetches, together, the index bounds (out of ``[0, E)`` raises), the number of non-finite
    ``routing_weights`` (any raises: a NaN weight would spread NaN over the whole output and every gradient)
    and the per-expert counts that cut ``order`` into segments. Shapes are assumed checked
    (``check_experts_inputs``).
    """
    top_k = router_indices.shape[1]
    flat = router_indices.reshape(-1).long()
    if flat.numel() == 0:
        empty = flat.new_empty(0)
        return ExpertPlan(order=empty, token_of_pair=empty, segments=(), num_pairs=0)
    summary = torch.stack((flat.min(), flat.max(), torch.isfinite(routing_weights).logical_not().sum()))
    counts = torch.bincount(flat.clamp(0, num_experts - 1), minlength=num_experts)
    lowest, highest, non_finite, *counts = torch.cat((summary, counts)).tolist()
    if lowest < 0 or highest >= num_experts:
        raise ValueError(
            f"{layer_name}: router_indices must lie in [0, {num_experts}) for {num_experts} experts, "
            f"got values in [{lowest}, {highest}]"
        )
    if non_finite:
        raise ValueError(
            f"{layer_name}: routing_weights has {non_finite} NaN or infinite value(s); they would turn the whole "
            "output and every gradient into NaN. Check the router's input (e.g. overflow in low precision)"
        )
    order = torch.argsort(flat, stable=True)
    segments, start = [], 0
    for expert, count in enumerate(counts):
        segments += _split(expert, start, start + count, rows_per_chunk)
        start += count
    return ExpertPlan(order=order, token_of_pair=order // top_k, segments=tuple(segments), num_pairs=flat.numel())
