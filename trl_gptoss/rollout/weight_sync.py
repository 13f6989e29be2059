"""The trainer side of a weight push: which tensors leave the model, under which names, in which groups.

Every engine's ``push_weights`` reads the model through ``pushed_tensors``, so the in-process copy, the
CPU HTTP push and the GPU NCCL push agree on names (checkpoint names: ``model.layers.0.self_attn.q_proj.weight``),
on PEFT handling (adapters merged for the push, unmerged afterwards) and on grouping (one decoder layer at a
time, so no second full copy of a 20B model is ever built).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

_PEFT_PREFIX = "base_model.model."
_LAYER_RE = re.compile(r"^(.*?\.layers\.\d+)\.")
_MODULES_TO_SAVE_RE = re.compile(r"\.modules_to_save\.[^.]+\.")
_BASE_LAYER_RE = re.compile(r"(?:\.base_layer)+\.")


def unwrap(model):
    """The bare model under DDP / accelerate wrappers (``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _is_peft(model) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "unmerge_adapter") and hasattr(model, "peft_config")


@contextlib.contextmanager
def _merged(model):
    """PEFT models: adapters merged into the base weights inside the block, unmerged after (even on error)."""
    if not _is_peft(model):
        yield
        return
    model.merge_adapter()
    try:
        yield
    finally:
        model.unmerge_adapter()


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


@contextlib.contextmanager
def pushed_tensors(model) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """Yield an iterator of ``(checkpoint_name, tensor)`` for every parameter of ``model`` (detached views).

    PEFT adapters are merged for as long as the block is open. Tied weights appear once (``state_dict``
    semantics drop the duplicates ``named_parameters`` already removes).
    """
    model = unwrap(model)
    with _merged(model), torch.no_grad():

        def tensors():
            for name, param in model.named_parameters():
                target = checkpoint_name(name)
                if target is not None:
                    yield target, param.detach()

        yield tensors()


def grouped_by_layer(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors that share a ``layer_key`` (parameters come in module order)."""
    group, key = [], None
    for name, tensor in named:
        this = layer_key(name)
        if group and this != key:
            yield group
            group = []
        group.append((name, tensor))
        key = this
    if group:
        yield group


def copy_weights_into(target: torch.nn.Module, source) -> None:
    """Copy ``source``'s parameters into ``target`` (same architecture); names and shapes must match."""
    params = dict(unwrap(target).named_parameters())
    seen = set()
    with pushed_tensors(source) as named, torch.no_grad():
        for name, tensor in named:
            if name not in params:
                raise ValueError(f"weight push: parameter {name!r} does not exist in the engine's model")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"weight push: parameter {name!r} has shape {tuple(tensor.shape)} but the "
                    f"engine's model expects {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(
            f"weight push: the pushed model has no parameter {missing[0]!r} "
            f"({len(missing)} engine parameters were not pushed)"
        )
