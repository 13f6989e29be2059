"""Worker side of the distributed tests: the sharded step vs an unsharded, per-document reference.

Every rank builds the same tiny GPT-OSS and the batches of ALL ranks (seeded by rank), so it can compute the
reference itself: plain upstream eager, one document at a time (no packing, no SP), full logits divided by the
temperature, log-softmax and entropy, loss of each rank's batch, gradient of ``sum_k loss_k / world`` -- what
plain DDP produces. The sharded run then does one ``forward_backward`` under DDP, FSDP2 or accelerate's DDP
(per-token values by ``selective_logprobs``, in tiles of ``chunk_size`` rows) and reports max |diff| of loss,
logits, log-probs, entropies and every parameter gradient, and the most rows of any ``[rows, V]`` tensor.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import trl_gptoss.parallel.attention as sp_attention
from trl_gptoss.experts.routing import record_routing
from trl_gptoss.parallel import ContextParallelPlugin, pack_rows, prepare_context_parallel
from trl_gptoss.parallel.batching import pad_to_multiple, shard
from trl_gptoss.parallel.head import HeadConfig
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.testing.distributed import set_rank_environment
from trl_gptoss.testing.routing import flip_near_ties
from trl_gptoss.trainer.replay import replay

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


def make_hostile_batch(seed: int):
    """``[3, 6]``: a 1-prompt + 1-completion-token row, a row of padding only, a prompt-only row. The packed
    row has 3 tokens (odd); at sp = 2 the second shard holds the last document's end and a pad: no label."""
    gen = torch.Generator().manual_seed(2000 + seed)
    ids = torch.randint(0, 512, (3, 6), generator=gen)
    attention_mask = torch.zeros_like(ids)
    completion_mask = torch.zeros(ids.shape)
    attention_mask[0, 2:4] = 1
    completion_mask[0, 3] = 1
    attention_mask[2, 2] = 1
    return ids, attention_mask, completion_mask, torch.randn(3, generator=gen)


def grpo_loss_fn(completion_mask, advantages, entropy_coef: float = 0.0):
    """GRPO-style loss on per-token log-probs ``[B, L]``: ratio * advantage, per-sequence token mean, minus
    ``entropy_coef`` times the mean entropy when entropies are passed (TRL's entropy bonus).

    On-policy the ratio is 1, so its value would not depend on the log-probs; the NLL term makes it do so.
    """

    def loss_fn(token_logps, token_entropies=None):
        mask = completion_mask.to(token_logps.dtype)
        ratio = torch.exp(token_logps - token_logps.detach())
        per_token = -ratio * advantages.to(token_logps.dtype)[:, None] - 0.1 * token_logps
        loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
        if token_entropies is not None:
            loss = loss - entropy_coef * (token_entropies * mask).sum() / mask.sum()
        return loss

    return loss_fn


def reference_logps_and_logits(model, ids, attention_mask, temperature: float = 1.0):
    """Each row alone through the unsharded model, full logits: ``token_logps [B, L]``, ``entropies [B, L]``
    (of ``softmax(logits / temperature)``) and the packed-order logits."""
    token_logps = torch.zeros(ids.shape, dtype=torch.float32 if model.dtype != torch.float64 else model.dtype)
    entropies = torch.zeros_like(token_logps)
    logits_packed = []
    for row in range(ids.shape[0]):
        cols = attention_mask[row].nonzero()[:, 0]
        if not len(cols):  # a padding row: no document
            continue
        tokens = ids[row, cols]
        logits = model(input_ids=tokens[None]).logits[0]
        logps = torch.log_softmax(logits[:-1].to(token_logps.dtype) / temperature, dim=-1)
        where = (torch.full_like(cols[1:], row), cols[1:])
        entropies = entropies.index_put(where, -(logps.exp() * logps).sum(dim=-1))
        token_logps = token_logps.index_put(where, logps.gather(-1, tokens[1:, None])[:, 0])
        logits_packed.append(logits.detach())
    return token_logps, entropies, torch.cat(logits_packed)


def build_model(dtype):
    """Tiny GPT-OSS in train mode with upstream eager experts (grouped_mm has no float64 kernel)."""
    model = tiny_gpt_oss(seed=MODEL_SEED, dtype=dtype).train()
    model.set_experts_implementation("eager")
    return model


def reference_step(dtype, batches, world, head: HeadConfig | None = None, entropy_coef: float = 0.0):
    head = head or HeadConfig()
    model = build_model(dtype)
    losses, logits, logps, entropies = [], [], [], []
    for ids, attention_mask, completion_mask, advantages in batches:
        token_logps, token_entropies, packed_logits = reference_logps_and_logits(
            model, ids, attention_mask, head.temperature
        )
        loss_fn = grpo_loss_fn(completion_mask, advantages, entropy_coef)
        losses.append(loss_fn(token_logps, token_entropies if head.entropy_grad else None))
        logits.append(packed_logits)
        logps.append(token_logps.detach())
        entropies.append(token_entropies.detach())
    (sum(losses) / world).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return [loss.detach() for loss in losses], logits, grads, logps, entropies


def wrap(model, how, rank, world):
    """``(wrapped model, accelerator or None)``: torch DDP, torch FSDP2 (decoder layers + root, and ``lm_head``
    as a unit of its own for "fsdp2-head"), or accelerate's DDP preparation."""
    if how == "ddp":
        return DistributedDataParallel(model), None
    if how in ("fsdp2", "fsdp2-head"):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if how == "fsdp2-head":  # lm_head its own unit: its weight is whole only inside its own forward
            fully_shard(model.lm_head, mesh=mesh)
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


class LargestVocabRows(TorchDispatchMode):
    """The most rows of any tensor an aten op creates with the vocabulary as last dimension (views are not
    counted: ``lm_head.weight.t()`` is ``[H, V]`` without allocating anything)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            vocab_last = isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab
            if vocab_last and t.untyped_storage().data_ptr() not in inputs:  # new memory: no view, no out=
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


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


def _head(scenario) -> tuple[HeadConfig, float]:
    """The scenario's head and entropy-bonus coefficient (entropies carry gradient when it is non-zero)."""
    coef = scenario.get("entropy_coef", 0.0)
    head = HeadConfig(
        temperature=scenario.get("temperature", 1.0), entropy_grad=bool(coef), chunk_size=scenario.get("chunk")
    )
    return head, coef


def _valid_diff(got, want, attention_mask):
    return _max_diff(got[attention_mask.bool()], want[attention_mask.bool()])


def engine_routes(dtype, ids, attention_mask) -> torch.Tensor:
    """``[B, L, layers, top_k]`` int16: the experts the reference (each document alone, unperturbed routers)
    chooses at every valid token, -1 on padding: what a rollout engine would report."""
    model = build_model(dtype)
    config = model.config
    routes = torch.full((*ids.shape, config.num_hidden_layers, config.num_experts_per_tok), -1, dtype=torch.int16)
    with torch.no_grad():
        for row in range(ids.shape[0]):
            cols = attention_mask[row].nonzero()[:, 0]
            if len(cols):
                with record_routing(model) as record:
                    model(input_ids=ids[row, cols][None])
                routes[row, cols] = torch.stack([t.to(torch.int16) for t in record.indices], dim=1)
    return routes


def _replay_rollout_routes(model, shard_routes):
    return replay(model, shard_routes, allow_missing=True)


def run_scenario(rank, world, scenario):
    dtype = getattr(torch, scenario["dtype"])
    sp_size = scenario["sp"]
    head, coef = _head(scenario)
    make = make_hostile_batch if scenario.get("batch") == "hostile" else make_batch
    batches = [make(seed=k) for k in range(world)]
    ref_losses, ref_logits, ref_grads, ref_logps, ref_entropies = reference_step(dtype, batches, world, head, coef)
    model = build_model(dtype)
    ids, attention_mask, completion_mask, advantages = batches[rank]
    routed = {}
    if scenario.get("routes"):  # routers flipped on near-ties, the reference's routes replayed over them
        flips = flip_near_ties(model)
        routed = dict(routes=engine_routes(dtype, ids, attention_mask), route_replay=_replay_rollout_routes)
    wrapped, accelerator = wrap(model, scenario["wrap"], rank, world)
    plugin = ContextParallelPlugin(sp_size=sp_size, inner_attention=scenario["inner"])
    runner = prepare_context_parallel(accelerator, wrapped, plugin, head)
    with first_sinks_on_every_rank(scenario.get("wrong_sinks", False)):
        with LargestVocabRows(model.config.vocab_size) as largest:
            loss_fn = grpo_loss_fn(completion_mask, advantages, coef)
            result = runner.forward_backward(ids, attention_mask, loss_fn, **routed)
        grad_diffs = compare_grads(full_grads(wrapped), ref_grads)
        # no-grad scoring of this rank's batch, by the trained model and by a separate frozen copy
        frozen_copy = build_model(dtype)
        scored = [runner.score(ids, attention_mask, **routed), runner.score(ids, attention_mask, model=frozen_copy)]
        if routed:
            flips.remove()  # the logits below are the plain forward's
        leader = rank - runner.sp.rank
        with LargestVocabRows(model.config.vocab_size) as control:  # the tracker sees real logits
            logits, start, valid = sharded_logits(runner, batches[leader], sp_size)
    keep = max(0, min(logits.shape[0], valid - start))
    report = {
        "loss": _max_diff(result.loss, ref_losses[rank]),
        "logits": _max_diff(logits[:keep], ref_logits[leader][start : start + keep]),
        "logps": _valid_diff(result.token_logps, ref_logps[rank], attention_mask),
        "entropy": _valid_diff(result.token_entropies, ref_entropies[rank], attention_mask) if coef else 0.0,
        **{f"grad_{kind}": diff for kind, diff in grad_diffs.items()},
        "score": max(_valid_diff(s[0] if isinstance(s, tuple) else s, ref_logps[rank], attention_mask) for s in scored),
        "ref_sinks_grad": max(float(g.abs().max()) for n, g in ref_grads.items() if n.endswith("sinks")),
        "vocab_rows": largest.rows,
        "vocab_rows_logits": control.rows,
        "logits_rows": logits.shape[0],
        "flipped_tokens": flips.count if routed else None,
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
