"""``enable_long_context``: swap every GPT-OSS decoder layer of a model for ``LongContextDecoderLayer``."""

from __future__ import annotations

import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer

from trl_gptoss.long_context.layer import LongContextDecoderLayer
from trl_gptoss.long_context.offload import CheckpointOffload

_OPTIONS = ("token_tile", "checkpoint_offload")


def validate_token_tile(name: str, value) -> None:
    """``value`` must be None (off) or a positive int (bools and floats refused): ``ValueError`` naming ``name``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive whole number of tokens (or null for no tiling), got {value!r}")


class LongContextHandle:
    """Returned by ``enable_long_context``; ``revert()`` (or leaving the ``with`` block) restores every layer's
    class. ``offload`` is the model's ``CheckpointOffload`` (None when off): its counters say what moved."""

    def __init__(self, swapped: list[tuple[torch.nn.Module, type]], offload: CheckpointOffload | None):
        self._swapped, self.offload = swapped, offload

    def revert(self) -> None:
        for module, original_class in self._swapped:
            module.__class__ = original_class
            for option in _OPTIONS:
                module.__dict__.pop(option, None)
        self._swapped = []

    def __enter__(self) -> LongContextHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def enable_long_context(
    model: torch.nn.Module, *, token_tile: int | None = None, offload_checkpoints: bool = False
) -> LongContextHandle:
    """Give every ``GptOssDecoderLayer`` of ``model`` the long-context options (class swap in place: same module
    objects and parameters, so optimizer state, PEFT and checkpoints are unaffected).

    token_tile: tokens per tile for the norms, router and experts (None: whole sequence).
    offload_checkpoints: the layers' gradient checkpoints go to host memory (takes effect where gradient
    checkpointing is on: ``model.gradient_checkpointing_enable()``, before or after this call).
    Swap before FSDP2's ``fully_shard`` (it subclasses the layer's class). Raises ``ValueError`` for a bad
    ``token_tile`` or a model without GPT-OSS decoder layers.
    """
    validate_token_tile("token_tile", token_tile)
    if not isinstance(offload_checkpoints, bool):
        raise ValueError(f"offload_checkpoints must be true or false, got {offload_checkpoints!r}")
    offload = CheckpointOffload() if offload_checkpoints else None
    swapped = []
    for module in model.modules():
        if isinstance(module, GptOssDecoderLayer):
            swapped.append((module, type(module)))
            if not isinstance(module, LongContextDecoderLayer):
                module.__class__ = LongContextDecoderLayer
            module.token_tile, module.checkpoint_offload = token_tile, offload
    if not swapped:
        raise ValueError(f"{type(model).__name__} has no GptOssDecoderLayer to give long-context options")
    return LongContextHandle(swapped, offload)


def enable_from_config(model: torch.nn.Module, args) -> LongContextHandle | None:
    """``enable_long_context`` with a trainer config's ``long_context_token_tile`` and
    ``long_context_offload_checkpoints``; None (nothing swapped) when both are off."""
    token_tile = getattr(args, "long_context_token_tile", None)
    offload = getattr(args, "long_context_offload_checkpoints", False)
    if token_tile is None and not offload:
        return None
    return enable_long_context(model, token_tile=token_tile, offload_checkpoints=offload)
