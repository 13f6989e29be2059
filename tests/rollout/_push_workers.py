"""Worker side of the ``push_tensors`` distributed tests (2 gloo ranks, FSDP2 on a tiny GPT-OSS)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from trl_gptoss.rollout.push import PushStats, push_layers
from trl_gptoss.testing import tiny_gpt_oss

LORA_TARGETS = dict(
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
)


def build(lora: bool):
    """The same tiny GPT-OSS on every rank (LoRA with non-zero B so the merge matters) and its merged copy."""
    model = tiny_gpt_oss(seed=0, initializer_range=0.15).train()
    model.set_experts_implementation("eager")
    if lora:
        import peft

        config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **LORA_TARGETS)
        model = peft.get_peft_model(model, config)
        reference = copy.deepcopy(model).merge_and_unload()
    else:
        reference = copy.deepcopy(model)
    return model, {n: p.detach().clone() for n, p in reference.named_parameters()}


def shard(model):
    decoder = model.base_model.model.model if hasattr(model, "peft_config") else model.model
    for layer in decoder.layers:
        fully_shard(layer)
    return fully_shard(model)


def local_state(model) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}


def push_rank(rank: int, world: int, lora: bool) -> dict:
    """Push from the FSDP2-sharded model holding one layer at a time; report exactness, memory, side effects."""
    torch.manual_seed(0)
    model, reference = build(lora)
    model = shard(model)
    before = local_state(model)
    stats = PushStats()
    received, mismatched, held_peak = [], [], 0
    for layer in push_layers(model, stats=stats):  # a pusher's view: one layer held at a time
        held_peak = max(held_peak, sum(t.numel() * t.element_size() for _, t in layer))
        received += [name for name, _ in layer]
        mismatched += [name for name, tensor in layer if not torch.equal(tensor, reference[name])]
        del layer
    after = local_state(model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    lora_params = [n for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
    # the adapters still train: one backward after the push reaches every LoRA factor
    model(
        input_ids=torch.tensor([[5, 40, 41, 42, 7, 300]]), labels=torch.tensor([[5, 40, 41, 42, 7, 300]])
    ).loss.backward()
    no_grad = [n for n, p in model.named_parameters() if "lora_" in n and (p.grad is None or not p.grad.abs().sum())]
    dist.barrier()
    return {
        "received": received,
        "expected": sorted(reference),
        "mismatched": mismatched,
        "changed": changed,
        "lora_params": len(lora_params),
        "lora_without_grad": no_grad,
        "peak_bytes": stats.peak_bytes,
        "live_after": stats.live_bytes,
        "max_layer_bytes": stats.max_layer_bytes,
        "held_peak": held_peak,
    }
