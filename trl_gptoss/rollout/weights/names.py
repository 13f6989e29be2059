"""Naming and grouping rules of a weight push: checkpoint names, decoder-layer keys, the layout check.

Every pusher reads the model through ``trl_gptoss.rollout.weights.push.push_tensors`` (FSDP2 shards gathered,
PEFT adapters merged into the gathered copy), so the in-process copy, the CPU HTTP push and the GPU NCCL push
agree on names (checkpoint names: ``model.layers.0.self_attn.q_proj.weight``) and on grouping (one decoder
layer at a time, so no second full copy of a 20B model is ever built).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

_PEFT_PREFIX = "base_model.model."
_LAYER_RE = re.compile(r"^(.*?\.layers\.\d+)\.")
_MODULES_TO_SAVE_RE = re.compile(r"\.modules_to_save\.[^.]+\.")
_BASE_LAYER_RE = re.compile(r"(?:\.base_layer)+\.")


def unwrap(model, *, peft: bool = False):
    """The bare model under DDP / accelerate wrappers (``.module``); with ``peft=True`` also under a PEFT
    wrapper (``get_base_model()``: the transformers model the adapters are injected into)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if peft and hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def checkpoint_name(name: str) -> str | None:
    """The checkpoint name of a ``named_parameters``/``named_buffers`` entry, ``None`` for adapter tensors."""
    if "lora_" in name or ".original_module." in name:  # adapters; the frozen copy of a modules_to_save module
        return None
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    # PEFT nests one ``base_layer`` per wrapped parameter (experts with LoRA on gate_up_proj AND down_proj)
    return _BASE_LAYER_RE.sub(".", _MODULES_TO_SAVE_RE.sub(".", name))


def layer_key(name: str) -> str:
    """Group key: ``model.layers.N`` for a decoder layer's tensors, ``""`` for the rest (embeddings, norm, head)."""
    match = _LAYER_RE.match(name)
    return match.group(1) if match else ""


def grouped_by_layer(
    named: Iterable[tuple[str, torch.Tensor]], key: Callable[[str], str] = layer_key
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``(name, tensor)`` whose names share a ``key`` (default ``layer_key``: parameters come
    in module order, so a run is one decoder layer)."""
    group, last = [], None
    for name, tensor in named:
        this = key(name)
        if group and this != last:
            yield group
            group = []
        group.append((name, tensor))
        last = this
    if group:
        yield group


def check_layout(pushed: dict[str, list[int]], served: dict[str, list[int]], where: str) -> None:
    """Refuse a push whose checkpoint names or shapes differ from what ``where`` serves (a server URL, or the
    in-process engine), before anything is sent; the error names the first differing parameter."""
    for name, shape in pushed.items():
        if name not in served:
            raise ValueError(f"weight push: parameter {name!r} does not exist in the checkpoint {where} serves")
        if list(served[name]) != list(shape):
            raise ValueError(f"weight push: parameter {name!r} has shape {shape} but {where} expects {served[name]}")
    missing = sorted(set(served) - set(pushed))
    if missing:
        raise ValueError(
            f"weight push: {where} serves {missing[0]!r} which the pushed model lacks ({len(missing)} missing)"
        )
