"""Worker for the FSDP2 long-context test (spawned by ``trl_gptoss.testing.distributed.launch``): every rank
trains the same batch, so FSDP2's averaged gradients equal one process's, with and without the options."""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import fully_shard

from trl_gptoss.long_context import enable_long_context

OPTIONS = {
    "plain": {},
    "offload": dict(offload_checkpoints=True),
    "tiles+offload": dict(token_tile=7, offload_checkpoints=True),
}


def _sharded_grads(model, ids, world, options) -> tuple[dict[str, torch.Tensor], int]:
    """Full gradients of one step under FSDP2 with ``options``, and how many layer inputs were offloaded."""
    model = copy.deepcopy(model)
    handle = enable_long_context(model, **options)  # before fully_shard: FSDP2 subclasses the swapped layer class
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss = model(input_ids=ids).logits.double().log_softmax(-1).mean()
    loss.backward()
    grads = {name: p.grad.full_tensor().detach() for name, p in model.named_parameters()}
    return grads, handle.offload.offloaded if handle.offload else 0


def compare_under_fsdp2(rank: int, world: int) -> dict:
    """Per option set: per parameter max |grad - plain grad| / max |plain grad| under FSDP2 (``diffs``), and
    the number of layer inputs offloaded (``offloaded``)."""
    from tests.long_context.helpers import tiny_model, token_ids

    model = tiny_model()
    ids = token_ids(model.config.vocab_size)
    runs = {name: _sharded_grads(model, ids, world, options) for name, options in OPTIONS.items()}
    plain, _ = runs.pop("plain")
    return {
        name: {
            "diffs": {p: ((g[p] - plain[p]).abs().max() / plain[p].abs().max()).item() for p in plain},
            "offloaded": offloaded,
        }
        for name, (g, offloaded) in runs.items()
    }
