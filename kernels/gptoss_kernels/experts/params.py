"""The parameters of one GPT-OSS experts layer, and the checks of every input the experts op takes."""

from __future__ import annotations

from typing import NamedTuple

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class ExpertParams(NamedTuple):
    """The four tensors of a GPT-OSS experts layer (``E`` experts, hidden size ``H``, intermediate size ``I``).

    gate_up_proj: ``[E, H, 2I]``, gate at even and up at odd columns. gate_up_proj_bias: ``[E, 2I]``.
    down_proj: ``[E, I, H]``. down_proj_bias: ``[E, H]``. Field names match ``GptOssExperts``' parameters.
    """

    gate_up_proj: torch.Tensor
    gate_up_proj_bias: torch.Tensor
    down_proj: torch.Tensor
    down_proj_bias: torch.Tensor

    @classmethod
    def of(cls, module) -> ExpertParams:
        """The parameters of any module that carries them under these names (e.g. ``GptOssExperts``)."""
        return cls(*(getattr(module, name) for name in cls._fields))

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]


def _check_params(params: ExpertParams) -> tuple[int, int]:
    """Shapes of the four parameters; returns ``(E, H)``."""
    if not isinstance(params, ExpertParams):
        raise TypeError(f"params must be an ExpertParams, got {type(params).__name__}")
    if params.gate_up_proj.dim() != 3 or params.gate_up_proj.shape[-1] % 2:
        raise ValueError(f"gate_up_proj must be [E, H, 2I], got {tuple(params.gate_up_proj.shape)}")
    num_experts, hidden_size, two_inter = params.gate_up_proj.shape
    expected = {
        "gate_up_proj_bias": (num_experts, two_inter),
        "down_proj": (num_experts, two_inter // 2, hidden_size),
        "down_proj_bias": (num_experts, hidden_size),
    }
    for name, shape in expected.items():
        if tuple(getattr(params, name).shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(getattr(params, name).shape)}")
    return num_experts, hidden_size


def _check_routing(hidden_states, router_indices, routing_weights, num_experts: int, hidden_size: int) -> None:
    """Shapes and dtypes of the tokens and their routing (values are checked by the plan's one host sync)."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or hidden_states.shape[1] != hidden_size:
        got = tuple(getattr(hidden_states, "shape", ()))
        raise ValueError(
            f"hidden_states must be [num_tokens, {hidden_size}] (flatten batch and sequence first), got {got}"
        )
    if hidden_states.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"hidden_states must be floating point, got {hidden_states.dtype}")
    num_tokens = hidden_states.shape[0]
    if router_indices is None or routing_weights is None:
        raise ValueError(f"router_indices and routing_weights are required, both [{num_tokens}, K]")
    shape = tuple(router_indices.shape)
    if len(shape) != 2 or shape[0] != num_tokens or not 1 <= shape[1] <= num_experts:
        raise ValueError(f"router_indices must have shape [{num_tokens}, K] with 1 <= K <= {num_experts}, got {shape}")
    if router_indices.dtype not in _INDEX_DTYPES:
        raise ValueError(f"router_indices must be an integer tensor, got {router_indices.dtype}")
    if tuple(routing_weights.shape) != shape:
        raise ValueError(
            f"routing_weights must have shape {shape} (same as router_indices), got {tuple(routing_weights.shape)}"
        )


def _check_dtypes_and_devices(hidden_states, router_indices, routing_weights, params: ExpertParams, autocast) -> None:
    """Everything on ``hidden_states``' device; routing weights and parameters in its dtype, or, under autocast
    (which casts them per matmul as it would for stock experts), in any floating dtype."""
    for name, tensor in (
        ("router_indices", router_indices),
        ("routing_weights", routing_weights),
        *zip(params._fields, params),
    ):
        if tensor.device != hidden_states.device:
            raise ValueError(f"{name} is on {tensor.device} but hidden_states is on {hidden_states.device}")
        if name == "router_indices" or tensor.dtype == hidden_states.dtype:
            continue
        if not autocast or tensor.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{name} has dtype {tensor.dtype} but hidden_states has {hidden_states.dtype}; "
                "cast them to one dtype (e.g. model.to(dtype)), or run under torch.autocast"
            )


def check_experts_inputs(
    hidden_states,
    router_indices,
    routing_weights,
    params: ExpertParams,
    rows_per_chunk=None,
    layer_name="experts",
    *,
    autocast: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``layer_name``, the argument, the expected shape and what to change.

    Shapes, dtypes, devices and ``rows_per_chunk`` only: no host sync (index range and finite routing weights
    are checked by ``build_expert_plan``'s single sync).
    """
    try:
        num_experts, hidden_size = _check_params(params)
        _check_routing(hidden_states, router_indices, routing_weights, num_experts, hidden_size)
        _check_dtypes_and_devices(hidden_states, router_indices, routing_weights, params, autocast)
        if rows_per_chunk is not None and (not isinstance(rows_per_chunk, int) or rows_per_chunk <= 0):
            raise ValueError(f"rows_per_chunk must be a positive int or None, got {rows_per_chunk!r}")
    except (ValueError, TypeError) as error:
        raise type(error)(f"{layer_name}: {error}") from None
