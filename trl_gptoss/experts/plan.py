"""Input checks and the sort-once routing plan shared by the forward and backward loops."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class ExpertPlan:
    """Where each (token, k) pair goes, sorted by expert.

    order: int64 ``[S]`` (S = T*K), a stable argsort of the flattened ``top_k_index``, so pairs of one expert
    form the contiguous slice ``order[start:end]``. token_of_pair: int64 ``[S]``, ``order // K`` (the token
    row of each sorted pair). segments: ``(expert, start, end)`` slices of at most ``rows_per_chunk`` rows,
    experts without tokens omitted.
    """

    order: torch.Tensor
    token_of_pair: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    num_pairs: int


def check_experts_inputs(
    hidden_states,
    top_k_index,
    top_k_weights,
    gate_up_proj,
    gate_up_proj_bias,
    down_proj,
    down_proj_bias,
    layer_name: str = "experts",
) -> None:
    """Raise ``ValueError`` naming the layer, the expected shape and what to change. Shapes only, no sync."""
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"{layer_name}: gate_up_proj must be [E, H, 2I] and down_proj [E, I, H], got "
            f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}"
        )
    num_experts, hidden_size, two_inter = gate_up_proj.shape
    expected = {
        "gate_up_proj_bias": (num_experts, two_inter),
        "down_proj": (num_experts, two_inter // 2, hidden_size),
        "down_proj_bias": (num_experts, hidden_size),
    }
    for name, tensor in (
        ("gate_up_proj_bias", gate_up_proj_bias),
        ("down_proj", down_proj),
        ("down_proj_bias", down_proj_bias),
    ):
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"{layer_name}: {name} must have shape {expected[name]}, got {tuple(tensor.shape)}"
            )
    if (
        not isinstance(hidden_states, torch.Tensor)
        or hidden_states.dim() != 2
        or hidden_states.shape[1] != hidden_size
    ):
        raise ValueError(
            f"{layer_name}: hidden_states must be [num_tokens, {hidden_size}] (flatten batch and "
            f"sequence first), got {tuple(getattr(hidden_states, 'shape', ()))}"
        )
    num_tokens = hidden_states.shape[0]
    if top_k_index is None or top_k_weights is None:
        raise ValueError(
            f"{layer_name}: router_indices and routing_weights are required, both [{num_tokens}, K]"
        )
    if (
        top_k_index.dim() != 2
        or top_k_index.shape[0] != num_tokens
        or not 1 <= top_k_index.shape[1] <= num_experts
    ):
        raise ValueError(
            f"{layer_name}: router_indices must have shape [{num_tokens}, K] with 1 <= K <= "
            f"{num_experts}, got {tuple(top_k_index.shape)}"
        )
    if top_k_index.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{layer_name}: router_indices must be an integer tensor, got {top_k_index.dtype}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(
            f"{layer_name}: routing_weights must have shape {tuple(top_k_index.shape)} (same as "
            f"router_indices), got {tuple(top_k_weights.shape)}"
        )
    if hidden_states.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{layer_name}: hidden_states must be floating point, got {hidden_states.dtype}")
    for name, tensor in (
        ("routing_weights", top_k_weights),
        ("gate_up_proj", gate_up_proj),
        ("gate_up_proj_bias", gate_up_proj_bias),
        ("down_proj", down_proj),
        ("down_proj_bias", down_proj_bias),
    ):
        if tensor.dtype != hidden_states.dtype:
            raise ValueError(
                f"{layer_name}: {name} has dtype {tensor.dtype} but hidden_states has "
                f"{hidden_states.dtype}; cast them to one dtype (e.g. model.to(dtype))"
            )
        if tensor.device != hidden_states.device:
            raise ValueError(
                f"{layer_name}: {name} is on {tensor.device} but hidden_states is on {hidden_states.device}"
            )
    if top_k_index.device != hidden_states.device:
        raise ValueError(
            f"{layer_name}: router_indices is on {top_k_index.device}, hidden_states on "
            f"{hidden_states.device}"
        )


def _split(expert: int, start: int, end: int, rows_per_chunk: int | None):
    if end == start:  # an expert without tokens costs nothing
        return []
    step = end - start if rows_per_chunk is None else rows_per_chunk
    return [(expert, lo, min(lo + step, end)) for lo in range(start, end, step)]


def build_expert_plan(
    hidden_states,
    top_k_index,
    top_k_weights,
    gate_up_proj,
    gate_up_proj_bias,
    down_proj,
    down_proj_bias,
    *,
    rows_per_chunk: int | None = None,
    layer_name: str = "experts",
) -> ExpertPlan:
    """Validate, then sort the flattened assignments once; one host sync (index bounds + per-expert counts)."""
    check_experts_inputs(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        gate_up_proj_bias,
        down_proj,
        down_proj_bias,
        layer_name,
    )
    if rows_per_chunk is not None and (not isinstance(rows_per_chunk, int) or rows_per_chunk <= 0):
        raise ValueError(
            f"{layer_name}: rows_per_chunk must be a positive int or None, got {rows_per_chunk!r}"
        )
    num_experts, top_k = gate_up_proj.shape[0], top_k_index.shape[1]
    flat = top_k_index.reshape(-1).long()
    if flat.numel() == 0:
        empty = flat.new_empty(0)
        return ExpertPlan(order=empty, token_of_pair=empty, segments=(), num_pairs=0)
    bounds = torch.stack((flat.min(), flat.max()))
    counts = torch.bincount(flat.clamp(0, num_experts - 1), minlength=num_experts)
    lowest, highest, *counts = torch.cat((bounds, counts)).tolist()
    if lowest < 0 or highest >= num_experts:
        raise ValueError(
            f"{layer_name}: router_indices must lie in [0, {num_experts}) for {num_experts} experts, "
            f"got values in [{lowest}, {highest}]"
        )
    order = torch.argsort(flat, stable=True)
    segments, start = [], 0
    for expert, count in enumerate(counts):
        segments += _split(expert, start, start + count, rows_per_chunk)
        start += count
    return ExpertPlan(
        order=order, token_of_pair=order // top_k, segments=tuple(segments), num_pairs=flat.numel()
    )
