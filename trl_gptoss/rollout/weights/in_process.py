"""``copy_weights_into``: the in-process engine's weight push, a copy of ``push_layers``' tensors into its model."""

from __future__ import annotations

import torch

from trl_gptoss.rollout.weights.names import check_layout, unwrap
from trl_gptoss.rollout.weights.push import push_layers, pushed_layout


def copy_weights_into(target: torch.nn.Module, source) -> None:
    """Copy ``source``'s weights (``push_tensors``: adapters merged, shards gathered) into ``target`` (same
    architecture, every process its own copy); names and shapes must match, checked before anything is copied.
    Collective when ``source`` is sharded: every rank calls it."""
    params = dict(unwrap(target).named_parameters())
    served = {name: list(param.shape) for name, param in params.items()}
    check_layout(pushed_layout(source), served, "the in-process engine")
    with torch.no_grad():
        for layer in push_layers(source, to_rank=None):
            for name, tensor in layer:
                params[name].copy_(tensor)
            del layer
