"""Worker side of the ``push_tensors`` distributed tests (2 gloo ranks, FSDP2 on a tiny GPT-OSS)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from trl_gptoss.rollout.weights.push import PushStats, push_layers
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


class RecordingPusher:
    """A pusher that keeps what it is sent (names, and whether each equals the reference) and can fail."""

    passes = ("all",)
    dtype = torch.float32

    def __init__(self, reference, fail_at_layer=None):
        self.reference, self.fail_at_layer = reference, fail_at_layer
        self.layers, self.mismatched, self.aborted = 0, [], False

    def begin(self, layout):
        assert sorted(layout) == sorted(self.reference)

    def send(self, pass_name, layer):
        if self.layers == self.fail_at_layer:
            raise ConnectionError("rollout server went away")
        self.layers += 1
        self.mismatched += [n for n, t in layer if not torch.equal(t, self.reference[n])]

    def end_pass(self, pass_name):
        pass

    def finish(self):
        pass

    def abort(self):
        self.aborted = True


def push_model_rank(rank: int, world: int, fail_at_layer) -> dict:
    """Every rank calls ``push_model`` on its FSDP2 shards; rank 0's pusher may fail mid-push."""
    from trl_gptoss.rollout.weights import push_model

    model, reference = build(lora=True)
    model = shard(model)
    pushers = []

    def make_pushers():
        pushers.append(RecordingPusher(reference, fail_at_layer))
        return pushers

    try:
        push_model(make_pushers, model)
        error = None
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        error = f"{type(exc).__name__}: {exc}"
    dist.barrier()  # every rank got here: nobody is left inside a collective
    return {
        "error": error,
        "built": len(pushers),
        "layers": pushers[0].layers if pushers else 0,
        "mismatched": pushers[0].mismatched if pushers else [],
        "aborted": pushers[0].aborted if pushers else False,
    }
