"""What the long-context options can serve, checked from a trainer config before any model loads, and the host
memory the checkpoint offload needs, checked from the model's config before its weights load."""

from __future__ import annotations

from pathlib import Path

from trl_gptoss.long_context.patch import validate_token_tile

TILE_FIELD = "long_context_token_tile"
OFFLOAD_FIELD = "long_context_offload_checkpoints"


def check_long_context_fields(
    token_tile, offload, *, gradient_checkpointing: bool, sp_size: int, routing_replay: str, router_aux_loss_coef
) -> None:
    """``ValueError`` naming the field and what to change for a bad value or a combination the options cannot
    serve."""
    validate_token_tile(TILE_FIELD, token_tile)
    if not isinstance(offload, bool):
        raise ValueError(f"{OFFLOAD_FIELD} must be true or false, got {offload!r}")
    if offload and not gradient_checkpointing:
        raise ValueError(
            f"{OFFLOAD_FIELD}: true moves the layers' gradient checkpoints to host memory, but "
            "gradient_checkpointing is off, so there are none; set gradient_checkpointing: true"
        )
    if offload and sp_size > 1:
        raise ValueError(
            f"{OFFLOAD_FIELD}: true cannot be combined with sp_size={sp_size}: the sequence-parallel runner "
            "runs its layers without gradient checkpointing; use one or the other"
        )
    if token_tile is not None and routing_replay != "off":
        raise ValueError(
            f"{TILE_FIELD}={token_tile} cannot be combined with routing_replay={routing_replay!r}: replay "
            "matches one router call per layer and forward, tiles call each router once per tile; set "
            f"routing_replay: off or {TILE_FIELD}: null"
        )
    if token_tile is not None and router_aux_loss_coef:
        raise ValueError(
            f"{TILE_FIELD}={token_tile} cannot be combined with router_aux_loss_coef={router_aux_loss_coef}: "
            "the load-balancing loss collects one router output per layer, tiles produce one per tile; set "
            f"router_aux_loss_coef: 0.0 or {TILE_FIELD}: null"
        )


def offload_host_bytes(*, num_layers: int, hidden_size: int, tokens: int, bytes_per_element: int = 2) -> int:
    """Host bytes the offload keeps: every layer's input (``tokens x hidden``) of one micro-batch."""
    return num_layers * tokens * hidden_size * bytes_per_element


def available_host_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (None where there is none)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def check_offload_host_memory(needed: int, available: int | None, *, tokens: int) -> None:
    """``ValueError`` naming the field when the host cannot hold the offloaded checkpoints (with a quarter of
    the available memory left for everything else: pinned pages cannot be swapped)."""
    if available is None or needed <= 0.75 * available:
        return
    raise ValueError(
        f"{OFFLOAD_FIELD}: true needs {needed / 2**30:.1f} GiB of pinned host memory for the layer checkpoints "
        f"of {tokens} tokens per micro-batch, but this host has {available / 2**30:.1f} GiB available (at most "
        "75% of it may be pinned); lower per_device_train_batch_size or max_completion_length, or set "
        f"{OFFLOAD_FIELD}: false"
    )


def check_offload_fits_host(args, model) -> None:
    """Before the weights load: the pinned host memory ``long_context_offload_checkpoints`` needs for one
    micro-batch (``per_device_train_batch_size x rollout_max_model_len`` tokens at most, every decoder layer's
    bf16 input) against what this host has available. ``model``: a model id/path or a loaded model."""
    if not getattr(args, OFFLOAD_FIELD, False):
        return
    if isinstance(model, str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
    else:
        config = model.config
    text = config.get_text_config()
    tokens = args.per_device_train_batch_size * args.rollout_max_model_len
    needed = offload_host_bytes(num_layers=text.num_hidden_layers, hidden_size=text.hidden_size, tokens=tokens)
    check_offload_host_memory(needed, available_host_bytes(), tokens=tokens)
