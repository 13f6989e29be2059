"""Worker side of the distributed tests: the sharded step vs an unsharded, per-document reference.

Every rank builds the same tiny GPT-OSS and the batches of ALL ranks (seeded by rank), so it can compute the
reference itself: plain upstream eager, one document at a time (no packing, no SP), loss of each rank's batch,
gradient of ``sum_k loss_k / world`` -- what plain DDP produces. The sharded run then does one
``forward_backward`` under DDP, FSDP2 or accelerate's DDP and reports max |diff| of loss, logits and every
parameter gradient.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import trl_gptoss.parallel.attention as sp_attention
from trl_gptoss.parallel import ContextParallelPlugin, pack_rows, prepare_context_parallel
from trl_gptoss.parallel.batching import pad_to_multiple, shard
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.testing.distributed import set_rank_environment

MODEL_SEED = 3
PROMPT_SLOTS, COMPLETION_SLOTS, ROWS = 12, 36, 3


def make_batch(seed: int):
    """GRPO-shaped batch ``[3, 48]``: left-padded prompts, right-padded completions, ~100 valid tokens."""
    gen = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, 512, (ROWS, PROMPT_SLOTS + COMPLETION_SLOTS), generator=gen)
    attention_mask = torch.zeros_like(ids)
    completion_mask = torch.zeros(ids.shape)
    for row in range(ROWS):
        prompt = int(torch.randint(6, PROMPT_SLOTS + 1, (1,), generator=gen))
        completion = int(torch.randint(15, COMPLETION_SLOTS + 1, (1,), generator=gen))
        attention_mask[row, PROMPT_SLOTS - prompt : PROMPT_SLOTS + completion] = 1
        completion_mask[row, PROMPT_SLOTS : PROMPT_SLOTS + completion] = 1
    advantages = torch.randn(ROWS, generator=gen)
    return ids, attention_mask, completion_mask, advantages


def grpo_loss_fn(completion_mask, advantages):
    """GRPO-style loss on per-token log-probs ``[B, L]``: ratio * advantage, per-sequence token mean.

    On-policy the ratio is 1, so its value would not depend on the log-probs; the NLL term makes it do so.
    """

    def loss_fn(token_logps):
        mask = completion_mask.to(token_logps.dtype)
        ratio = torch.exp(token_logps - token_logps.detach())
        per_token = -ratio * advantages.to(token_logps.dtype)[:, None] - 0.1 * token_logps
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1)).mean()

    return loss_fn


def reference_logps_and_logits(model, ids, attention_mask):
    """Each row alone through the unsharded model: ``token_logps [B, L]`` and packed-order logits."""
    token_logps = torch.zeros(ids.shape, dtype=torch.float32 if model.dtype != torch.float64 else model.dtype)
    logits_packed = []
    for row in range(ids.shape[0]):
        cols = attention_mask[row].nonzero()[:, 0]
        tokens = ids[row, cols]
        logits = model(input_ids=tokens[None]).logits[0]
        logps = torch.log_softmax(logits[:-1].to(token_logps.dtype), dim=-1)
        logps = logps.gather(-1, tokens[1:, None])[:, 0]
        token_logps = token_logps.index_put((torch.full_like(cols[1:], row), cols[1:]), logps)
        logits_packed.append(logits.detach())
    return token_logps, torch.cat(logits_packed)


def build_model(dtype):
    """Tiny GPT-OSS in train mode with upstream eager experts (grouped_mm has no float64 kernel)."""
    model = tiny_gpt_oss(seed=MODEL_SEED, dtype=dtype).train()
    model.set_experts_implementation("eager")
    return model


def reference_step(dtype, batches, world):
    model = build_model(dtype)
    losses, logits, logps = [], [], []
    for ids, attention_mask, completion_mask, advantages in batches:
        token_logps, packed_logits = reference_logps_and_logits(model, ids, attention_mask)
        losses.append(grpo_loss_fn(completion_mask, advantages)(token_logps))
        logits.append(packed_logits)
        logps.append(token_logps.detach())
    (sum(losses) / world).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return [loss.detach() for loss in losses], logits, grads, logps


def wrap(model, how, rank, world):
    """``(wrapped model, accelerator or None)``: torch DDP, torch FSDP2, or accelerate's DDP preparation."""
    if how == "ddp":
        return DistributedDataParallel(model), None
    if how == "fsdp2":
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh), None
    if how == "accelerate":
        # accelerate adopts the gloo group the harness initialised; these variables make it see MULTI_CPU
        set_rank_environment(rank, world)
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        return accelerator.prepare(model), accelerator
    raise ValueError(how)


def full_grads(wrapped):
    """Parameter gradients as full tensors (FSDP2 keeps DTensor shards; gathering is a collective)."""
    grads = {}
    for name, param in wrapped.named_parameters():
        grad = param.grad
        if grad is None:
            missing = [n for n, p in wrapped.named_parameters() if p.grad is None]
            raise AssertionError(f"no gradient for {missing}")
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        grads[name.removeprefix("module.")] = grad.detach()
    return grads


@contextlib.contextmanager
def first_sinks_on_every_rank(enabled: bool):
    """Negative control: every rank takes the sinks of heads [0, Hq/sp) instead of its own."""
    original = sp_attention.select_local_sinks
    if enabled:
        sp_attention.select_local_sinks = lambda sinks, rank, heads: original(sinks, 0, heads)
    try:
        yield
    finally:
        sp_attention.select_local_sinks = original


def sharded_logits(runner, batch, sp_size):
    """Logits of this rank's shard of the group leader's packed row (every group member runs it)."""
    packed = pack_rows(batch[0], batch[1])
    ids, pos = (pad_to_multiple(t, sp_size, 0) for t in (packed.input_ids, packed.positions))
    rank = runner.sp.rank
    with torch.no_grad():
        logits = runner.local_logits(shard(ids, rank, sp_size), shard(pos, rank, sp_size))
    start = rank * (ids.shape[0] // sp_size)
    return logits, start, len(packed)


def _max_diff(a, b):
    return float((a.double() - b.double()).abs().max())


def compare_grads(grads, ref_grads):
    worst = {"sinks": 0.0, "attention": 0.0, "other": 0.0}
    for name, ref in ref_grads.items():
        kind = "sinks" if name.endswith("sinks") else "attention" if ".self_attn." in name else "other"
        worst[kind] = max(worst[kind], _max_diff(grads[name], ref))
    return worst


def run_scenario(rank, world, scenario):
    dtype = getattr(torch, scenario["dtype"])
    sp_size = scenario["sp"]
    batches = [make_batch(seed=k) for k in range(world)]
    ref_losses, ref_logits, ref_grads, ref_logps = reference_step(dtype, batches, world)
    model = build_model(dtype)
    wrapped, accelerator = wrap(model, scenario["wrap"], rank, world)
    plugin = ContextParallelPlugin(sp_size=sp_size, inner_attention=scenario["inner"])
    runner = prepare_context_parallel(accelerator, wrapped, plugin)
    ids, attention_mask, completion_mask, advantages = batches[rank]
    with first_sinks_on_every_rank(scenario.get("wrong_sinks", False)):
        result = runner.forward_backward(ids, attention_mask, grpo_loss_fn(completion_mask, advantages))
        grad_diffs = compare_grads(full_grads(wrapped), ref_grads)
        leader = rank - runner.sp.rank
        logits, start, valid = sharded_logits(runner, batches[leader], sp_size)
        # no-grad scoring of this rank's batch, by the trained model and by a separate frozen copy
        frozen_copy = build_model(dtype)
        scored = [runner.score(ids, attention_mask), runner.score(ids, attention_mask, model=frozen_copy)]
    keep = max(0, min(logits.shape[0], valid - start))
    report = {
        "loss": _max_diff(result.loss, ref_losses[rank]),
        "logits": _max_diff(logits[:keep], ref_logits[leader][start : start + keep]),
        **{f"grad_{kind}": diff for kind, diff in grad_diffs.items()},
        "score": max(_max_diff(logps, ref_logps[rank]) for logps in scored),
        "ref_sinks_grad": max(float(g.abs().max()) for n, g in ref_grads.items() if n.endswith("sinks")),
    }
    dist.barrier()
    return report


def equivalence_worker(rank, world, scenarios):
    return {scenario["id"]: run_scenario(rank, world, scenario) for scenario in scenarios}


def _error_of(call):
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def bad_input_worker(rank, world):
    """Each bad setting must raise the same ValueError on every rank, without leaving a peer blocked."""
    model = build_model(torch.float32)
    report = {
        "sp_not_dividing_world": _error_of(
            lambda: prepare_context_parallel(None, model, ContextParallelPlugin(sp_size=world + 1))
        ),
        "sp_not_dividing_heads": _error_of(
            lambda: prepare_context_parallel(
                None, tiny_gpt_oss(num_attention_heads=3, num_key_value_heads=1), ContextParallelPlugin(sp_size=2)
            )
        ),
    }
    runner = prepare_context_parallel(None, DistributedDataParallel(model), ContextParallelPlugin(sp_size=world))
    length = 1 if rank == 0 else 40  # only rank 0's micro-batch is too short
    ids = torch.randint(0, 512, (1, length))
    report["sequence_shorter_than_sp"] = _error_of(
        lambda: runner.forward_backward(ids, None, lambda logps: logps.sum())
    )
    dist.barrier()  # reached by every rank only if none is stuck in a collective
    return report
