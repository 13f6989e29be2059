"""A model written as a transformers checkpoint one decoder layer at a time (``push_layers``): FSDP2 shards
gathered to rank 0, PEFT adapters merged into copies, never the whole model in one process's memory. The
rollout server starts from such a copy; so does the final save of a sharded FSDP2 run (``trainer/final_save``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"


def save_merged_checkpoint(model, path: Path | None, config_dtype: torch.dtype | None = None) -> None:
    """Write ``model`` at ``path``: one safetensors file per ``push_layers`` group, then its config (``dtype`` set
    to ``config_dtype`` when given) and, last, the index, so a save cut short is not a loadable checkpoint.
    Collective under ``torch.distributed``: every rank calls it; rank 0, whose ``path`` is set, writes."""
    from safetensors.torch import save_file

    from trl_gptoss.rollout.weights.names import unwrap
    from trl_gptoss.rollout.weights.push import push_layers

    weight_map = {}
    for number, layer in enumerate(push_layers(model, to_rank=0), start=1):
        name = f"model-{number:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in layer}, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys((n for n, _ in layer), name))
        del layer
    if path is None:
        return
    base = unwrap(model, peft=True)
    config = copy.deepcopy(base.config)
    config.architectures = [type(base).__name__]  # what vLLM picks the model class (and its tasks) by
    if config_dtype is not None:
        config.dtype = config_dtype
    config.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(path)
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
