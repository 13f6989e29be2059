"""``push_tensors(model)``: the trainer's weights as full checkpoint tensors, one decoder layer at a time.

Every rank of a training job calls it and iterates it to the end, in the same order: FSDP2 shards (``DTensor``
parameters) are gathered with a collective per tensor, so all ranks must take part; only the pushing rank
(``to_rank``, default 0) receives the ``(checkpoint_name, full_tensor)`` pairs, the others get nothing.

PEFT LoRA adapters are merged into the *gathered copy* of each adapted weight, never into the trained
parameter (so adapters stay trainable and the optimizer state stays valid):

- ``nn.Linear`` targets: ``W' = W + s * B @ A`` with ``A: [r, in]``, ``B: [out, r]``, ``s = alpha / r`` (or
  ``alpha / sqrt(r)`` with rsLoRA);
- expert targets (``target_parameters``, a ``[E, d0, d1]`` parameter): ``A: [E*r, .]`` viewed ``[E, r, .]``,
  ``B: [., r*E]`` viewed ``[., r, E]``, and ``W'[e] = W[e] + s * (B[:, :, e] @ A[e])`` (transposed when the
  stored layout is ``[E, in, out]``), the same arithmetic as PEFT's ``get_delta_weight``.

Deltas are computed in row (or expert) chunks sized so that what is alive at once stays within one layer's
full weights (``PushStats`` measures it). A tensor a consumer keeps is the consumer's to free; consumers that
group by layer (``grouped_by_layer``) hold one layer at a time. DeepSpeed ZeRO-3 parameters are refused:
their partitions are not gathered here, and pushing them would send empty shards.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trl_gptoss.rollout.weights.names import checkpoint_name, grouped_by_layer, layer_key, unwrap

ZERO3_MESSAGE = (
    "DeepSpeed ZeRO-3 partitions parameters in a way the weight push does not gather; pushing them would send "
    "empty shards. Use FSDP2 instead (accelerate config `distributed_type: FSDP`, `fsdp_version: 2`), or "
    "DeepSpeed ZeRO-1/2, whose parameters are whole on every rank"
)


@dataclass
class PushStats:
    """Bytes of the tensors ``push_tensors`` allocated that are still alive (gathered copies, merge chunks,
    casts), their peak, and the largest layer's full weights (adapters included) in the trainer's dtype."""

    live_bytes: int = 0
    peak_bytes: int = 0
    max_layer_bytes: int = 0
    tensors: int = 0
    _finalizers: list = field(default_factory=list, repr=False)

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._finalizers.append(weakref.finalize(tensor, self._release, size))
        return tensor

    def _release(self, size: int) -> None:
        self.live_bytes -= size


@dataclass
class _Adapter:
    """One LoRA adapter on one weight: its factors and scaling, and how the delta is laid out."""

    lora_a: torch.nn.Parameter
    lora_b: torch.nn.Parameter
    scaling: float
    num_experts: int  # 0: a 2-D weight (Linear, or a 2-D target parameter)
    transposed: bool  # experts stored [E, in, out]: the delta of expert e is (B_e @ A_e).T


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _refuse_zero3(name: str, param) -> None:
    if hasattr(param, "ds_id") or hasattr(param, "ds_status"):
        raise ValueError(f"weight push: parameter {name!r} is a DeepSpeed ZeRO-3 partition. {ZERO3_MESSAGE}")


def _adapters_by_weight(model) -> dict[int, list[_Adapter]]:
    """``id(base weight) -> adapters to merge into it`` for every PEFT LoRA layer of ``model``."""
    adapters: dict[int, list[_Adapter]] = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "get_base_layer")):
            continue
        if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
            continue  # already inside the base weight, or switched off: the base weight is what the model runs
        param = module.get_param() if hasattr(module, "get_param") else module.get_base_layer().weight
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            if adapter in getattr(module, "lora_variant", {}) or module.use_dora.get(adapter, False):
                raise ValueError(f"weight push: {name!r} uses a LoRA variant (DoRA, ...); only plain LoRA is merged")
            if module.lora_bias.get(adapter, False) or getattr(module, "fan_in_fan_out", False):
                raise ValueError(f"weight push: {name!r} uses lora_bias or fan_in_fan_out, which are not merged")
            experts = getattr(module, "num_experts", 1) if param.dim() == 3 else 0
            adapters.setdefault(id(param), []).append(
                _Adapter(
                    module.lora_A[adapter].weight,
                    module.lora_B[adapter].weight,
                    float(module.scaling[adapter]),
                    experts,
                    not getattr(module, "_did_swap_in_out_features", False),
                )
            )
    return adapters


def pushed_layout(model) -> dict[str, list[int]]:
    """``{checkpoint name: full shape}`` of what ``push_tensors`` yields, read from metadata (no collective):
    a ``DTensor``'s ``shape`` is the global one."""
    layout = {}
    for name, param in unwrap(model).named_parameters():
        _refuse_zero3(name, param)
        target = checkpoint_name(name)
        if target is not None:
            layout[target] = list(param.shape)
    return layout


def _gather(param, dtype: torch.dtype | None, receive: bool, stats: PushStats) -> torch.Tensor | None:
    """The full tensor of ``param`` (a collective for DTensors: every rank calls); ``None`` where not received.
    Always a fresh tensor on the receiving rank unless it is a plain parameter needing no cast (then a view)."""
    if _is_dtensor(param):
        local = param.detach()
        if dtype is not None and local.dtype != dtype:
            local = local.to(dtype)  # cast the shard: the collective moves the push dtype, not the trainer's
        full = local.full_tensor()
        if not receive:
            return None
        if full.untyped_storage().data_ptr() == param.to_local().untyped_storage().data_ptr():
            full = full.clone()  # a replicated placement hands back the parameter's own storage
        return stats.track(full)
    if not receive:
        return None
    full = param.detach()
    if dtype is not None and full.dtype != dtype:
        return stats.track(full.to(dtype))
    return full


def _merge_into(full: torch.Tensor, adapter: _Adapter, stats: PushStats, budget: int) -> None:
    """``full += delta`` of one adapter: 3-D (expert) weights in chunks of experts that fit in ``budget -
    live`` bytes (one expert at least; slicing the experts leaves PEFT's arithmetic bit for bit), 2-D in one
    piece."""
    lora_a = adapter.lora_a.full_tensor() if _is_dtensor(adapter.lora_a) else adapter.lora_a.detach()
    lora_b = adapter.lora_b.full_tensor() if _is_dtensor(adapter.lora_b) else adapter.lora_b.detach()
    if full is None:
        return  # this rank only took part in the gathers
    if _is_dtensor(adapter.lora_a):
        lora_a, lora_b = stats.track(lora_a), stats.track(lora_b)
    if adapter.num_experts:
        experts = adapter.num_experts
        a = lora_a.reshape(experts, -1, lora_a.shape[-1])  # [E, r, in]
        b = lora_b.reshape(lora_b.shape[0], -1, experts)  # [out, r, E]
        spec = "o r e, e r i -> e i o" if adapter.transposed else "o r e, e r i -> e o i"
        unit, total = full[0].numel() * full.element_size(), experts

        def delta(lo, hi):
            return torch.einsum(spec, b[:, :, lo:hi], a[lo:hi]).mul_(adapter.scaling)  # in place: one buffer

        step = max(1, (budget - stats.live_bytes) // max(unit, 1))
    else:  # one piece: a row-chunked matmul rounds differently from PEFT's merge; 2-D targets are small
        total = step = full.shape[0]

        def delta(lo, hi):
            return (lora_b @ lora_a).mul_(adapter.scaling)

    for lo in range(0, total, step):
        hi = min(lo + step, total)
        chunk = stats.track(delta(lo, hi))
        full[lo:hi] += chunk.to(full.dtype)
        del chunk


def _layer_runs(model) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive ``named_parameters`` runs that share a decoder layer (adapter parameters included)."""
    return grouped_by_layer(model.named_parameters(), key=_run_key)


def _run_key(name: str) -> str:
    """``layer_key`` of a parameter name, adapter tensors (no checkpoint name) with the layer they adapt."""
    return layer_key(checkpoint_name(name) or name.removeprefix("base_model.model."))


def push_layers(
    model,
    *,
    dtype: torch.dtype | None = None,
    to_rank: int | None = 0,
    select: Callable[[str], bool] | None = None,
    stats: PushStats | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``push_tensors`` one layer per item: a list of ``(checkpoint_name, full_tensor)`` per decoder layer (and
    per run of non-layer tensors), nothing on the ranks that do not receive. No look-ahead: the next layer's
    first tensor is gathered only after the consumer asks for it."""
    model = unwrap(model)
    stats = stats if stats is not None else PushStats()
    receive = to_rank is None or _rank() == to_rank
    for name, param in model.named_parameters():  # before anything is sent: never a partial push
        _refuse_zero3(name, param)
    adapters = _adapters_by_weight(model)
    with torch.no_grad():
        for run in _layer_runs(model):
            budget = sum(p.numel() * p.element_size() for _, p in run)
            stats.max_layer_bytes = max(stats.max_layer_bytes, budget)
            named = [(checkpoint_name(n), p) for n, p in run]
            named = [(n, p) for n, p in named if n is not None and (select is None or select(n))]
            # adapted 2-D weights first, then adapted experts (their merge needs transient room), then the rest
            named.sort(key=lambda item: 2 if id(item[1]) not in adapters else int(item[1].dim() == 3))
            layer = []
            for target, param in named:
                full = _full_copy(param, adapters.get(id(param), []), dtype, receive, stats, budget)
                if full is not None:
                    stats.tensors += 1
                    layer.append((target, full))
                del full
            if layer:
                yield layer
            del layer


def _full_copy(param, merging, dtype, receive, stats, budget) -> torch.Tensor | None:
    full = _gather(param, None if merging else dtype, receive, stats)
    if merging and full is not None and full.data_ptr() == param.data_ptr():
        full = stats.track(full.clone())  # never merge into the trained weight
    for adapter in merging:
        _merge_into(full, adapter, stats, budget)
    if merging and full is not None and dtype is not None and full.dtype != dtype:
        full = stats.track(full.to(dtype))
    return full


def push_tensors(
    model,
    *,
    dtype: torch.dtype | None = None,
    to_rank: int | None = 0,
    select: Callable[[str], bool] | None = None,
    stats: PushStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(checkpoint_name, full_tensor)`` for every parameter of ``model``, one decoder layer at a time.

    Collective: every rank calls it and iterates it to the end. ``to_rank``: the rank that receives the
    tensors (``None``: every rank). ``dtype``: cast to it (sharded tensors are cast before the gather; merged
    ones after the merge). ``select(checkpoint_name)``: push only these (decided by name, so the same on every
    rank). ``stats``: filled with the memory this iterator allocates. A layer's tensors are gathered
    together and released before the next layer's are.
    """
    for layer in push_layers(model, dtype=dtype, to_rank=to_rank, select=select, stats=stats):
        while layer:
            yield layer.pop(0)
