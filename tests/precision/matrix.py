"""The precision matrix: one GRPO step per precision setup, and its loss pass judged against stock transformers.

A cell is weights {fp32, bf16} x autocast {off, bf16, fp16} x LoRA {none, attention + experts} x layout {one
process, FSDP2 over two gloo ranks}. ``run_cell`` builds a ``GptOssGRPOTrainer`` for it (``fa3_sink``,
``gptoss_sequential``, ``selective_logprobs``, the in-process ``transformers`` engine, the small Harmony
tokenizer), trains one real step, then runs the trainer's own loss pass (``compute_loss`` under the trainer's
loss context, then backward: what ``training_step`` does) on one fixed batch of real Harmony tool-use
trajectories, three times:

- **ours**: the trained policy as the trainer holds it (accelerate-prepared; sharded on the FSDP2 layout);
- **stock**: the same weights and adapters in the same dtypes with transformers' eager attention, its eager
  experts and a plain log-softmax head, prepared the same way (FSDP2 sharding and mixed precision included);
- **ref64**: the same values upcast to float64, stock implementations, no autocast, unsharded.

The three passes route every token to ref64's experts (``replay_routing``): top-k is a discrete choice, and
low-precision noise flips near-ties (tens of the batch's 780 tokens in bf16) in ours and in stock differently,
which would make both errors measure which tokens flipped rather than the arithmetic. ``judge`` then applies
STYLE.md #3 to every named quantity -- the per-token log-probs, the loss and each trainable parameter's gradient
(sinks, router, experts, LoRA A/B): ``|ours - ref64| <= 2 |stock - ref64| + atol``. Results are JSON (the FSDP2
cells come back from spawned ranks).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from dataclasses import asdict, dataclass

import torch

WEIGHTS = {"fp32": torch.float32, "bf16": torch.bfloat16}
AUTOCAST = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
LAYOUTS = ("single", "fsdp2")
MODEL_OVERRIDES = dict(initializer_range=0.15)  # peaked distributions: log-probs far from -log(V)
# One optimizer step every dtype can represent: bf16 weights of magnitude ~0.15 have an ulp of ~1e-3 and a plain
# optimizer rounds smaller updates away (the trainer's master-weights guard refuses RL learning rates there).
LEARNING_RATE = 1e-2
ENTROPY_COEF = 0.1  # the entropies' gradient is a visible part of every gradient
ADVANTAGES = (1.0, -0.75, 0.5)  # one per row of the fixed batch (0, 1 and 2 tool calls)
# STYLE.md #3's atol, in units of the cell's compute dtype (eps * max |ref64| of the quantity). Measured on this
# model over 12 seeds x {fp32, fp32 + bf16 autocast, fp32 + fp16 autocast, bf16}: every quantity but two stays
# within 2x stock's error with no atol at all (ours/stock <= 1.8); 2 ulps absorb a last rounding that lands on
# the other side of ref64 for a scalar such as the loss.
ATOL_ULPS = 2
# The sinks' and the routers' bias gradients have 4 elements each and are sums over all 780 tokens whose terms
# nearly cancel (each token's router-logit gradients sum to zero over its experts): both errors are ~10 ulps of
# the result and which of two such draws is larger is a coin toss -- ours/stock ranged 0.07..5.5 over the seeds
# above with no trend, needing up to 6.1 ulps at the model level and 9.6 in one FSDP2 cell. 16 ulps covers that
# tail (12% of the result in bf16, 2e-6 in fp32); an ignored sink or a wrongly cast path is off by far more, and
# the fp32 cells still catch a 1% error in dsinks.
CANCELLING_SUMS = ("self_attn.sinks", "mlp.router.bias")
ATOL_ULPS_CANCELLING = 16


@dataclass(frozen=True)
class Cell:
    weights: str  # WEIGHTS key
    autocast: str  # AUTOCAST key
    lora: bool
    layout: str  # LAYOUTS entry

    @property
    def id(self) -> str:
        autocast = "no_autocast" if self.autocast == "off" else f"{self.autocast}_autocast"
        return f"{self.weights}_weights-{autocast}-{'lora' if self.lora else 'full'}-{self.layout}"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The lowest precision the cell's matmuls run in."""
        return AUTOCAST[self.autocast] or WEIGHTS[self.weights]


def all_cells(layout: str) -> list[Cell]:
    return [Cell(w, a, lora, layout) for w in WEIGHTS for a in AUTOCAST for lora in (False, True)]


# -- the fixed batch ------------------------------------------------------------------------------------------
def fixed_batch(tokenizer, num_processes: int = 1) -> dict:
    """TRL's loss-pass inputs for the three scripted tool-use trajectories of ``tests.trainer.helpers``
    (prompts left-padded, completions right-padded, tool output masked by ``tool_mask``), the same on every rank."""
    from tests.rollout.loop_helpers import AddTool
    from tests.trainer.helpers import real_trajectories

    rollouts = real_trajectories(tokenizer, [AddTool()])
    pad, rows = tokenizer.pad_token_id, len(rollouts)
    prompt_width = max(len(r.prompt_ids) for r in rollouts)
    completion_width = max(len(r.completion_ids) for r in rollouts)
    batch = {
        "prompt_ids": torch.full((rows, prompt_width), pad, dtype=torch.long),
        "prompt_mask": torch.zeros(rows, prompt_width, dtype=torch.long),
        "completion_ids": torch.full((rows, completion_width), pad, dtype=torch.long),
        "completion_mask": torch.zeros(rows, completion_width, dtype=torch.long),
        "tool_mask": torch.zeros(rows, completion_width, dtype=torch.long),
    }
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        batch["prompt_ids"][i, prompt_width - p :] = torch.tensor(r.prompt_ids)
        batch["prompt_mask"][i, prompt_width - p :] = 1
        batch["completion_ids"][i, :c] = torch.tensor(r.completion_ids)
        batch["completion_mask"][i, :c] = 1
        batch["tool_mask"][i, :c] = torch.tensor(r.completion_mask)
    assert (batch["tool_mask"] < batch["completion_mask"]).any(), "no tool output in the batch"
    batch["advantages"] = torch.tensor(ADVANTAGES[:rows], dtype=torch.float32)
    # TRL's "dapo" normalizer: tokens of the generation batch over all processes, divided back by the number of
    # processes -- every rank holds the same rows, so each rank's loss (and FSDP2's mean gradient) is one process's
    batch["num_items_in_batch"] = (batch["completion_mask"] * batch["tool_mask"]).sum() * num_processes
    return batch


# -- the stock reference --------------------------------------------------------------------------------------
def add_plain_logprobs_head(model, temperature: float) -> None:
    """Serve ``model(..., labels=labels, fused_lm_head=True)`` the plain way: the full ``[B, T, V]`` logits of
    ``lm_head`` (in the dtype autocast gives them), upcast to fp32 as transformers' own loss does (float64 stays
    float64), ``log_softmax``, gather; entropy ``-sum p log p``. The contract of ``add_selective_logprobs_head``;
    call on the bare model (under PEFT: ``get_base_model()``)."""
    from trl.trainer.utils import FusedCausalLMOutput

    fallback = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return fallback(*args, labels=labels, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]
        labels = labels[:, 1:]
        logits = self.lm_head(hidden)
        log_softmax = (logits if logits.dtype == torch.float64 else logits.float()).div(temperature).log_softmax(-1)
        mask = labels != -100
        log_probs = log_softmax.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
        entropy = -(log_softmax.exp() * log_softmax).sum(-1) * mask
        loss = -log_probs.sum() / mask.sum().clamp(min=1)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask, aux_loss=None)

    model.forward = types.MethodType(forward, model)


def full(tensor):
    """An FSDP2 DTensor as a plain full tensor (a collective); other tensors unchanged."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def stock_model(config, state: dict, dtype: torch.dtype, lora: bool, temperature: float):
    """A tiny GPT-OSS with transformers' eager attention and eager experts holding ``state`` (the trained
    policy's weights and adapters, each in the dtype the policy holds it in -- or all float64 for ``float64``)."""
    from tests.trainer.helpers import lora_config
    from trl_gptoss.testing import tiny_gpt_oss

    model = tiny_gpt_oss(copy.deepcopy(config), dtype=dtype)
    model.set_experts_implementation("eager")
    if lora:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config())
    if dtype == torch.float64:
        model.double()
        state = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(state, strict=True)
    add_plain_logprobs_head(model.get_base_model() if lora else model, temperature)
    return model.train()


# -- one loss pass --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def policy_logps(trainer):
    """Record the per-token log-probs the trainer's loss is computed from (its log-prob hook's results)."""
    original = trainer._get_per_token_logps_and_entropies
    seen = []

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out[0].detach())
        return out

    trainer._get_per_token_logps_and_entropies = spy
    try:
        yield seen
    finally:
        del trainer._get_per_token_logps_and_entropies


def loss_pass(trainer, model, batch: dict, routing, autocast: bool = True) -> dict:
    """What ``training_step`` does with one micro-batch: the loss under the trainer's loss context, backward.

    ``routing``: a ``RoutingRecord`` to route by, or an empty list to record this pass's routing into.
    ``autocast=False`` switches the trainer's autocast off (the float64 reference: autocast never touches float64,
    but the fp16 cells' emulated autocast would cast its fp32 adapters' inputs otherwise).
    Returns the loss-pass log-probs (completion tokens the loss counts), the loss, and per trainable parameter
    name its gradient (full tensor) and the dtypes of parameter and gradient.
    """
    from trl_gptoss.experts.routing import record_routing, replay_routing

    model.train()
    model.zero_grad(set_to_none=True)
    context = trainer.compute_loss_context_manager() if autocast else contextlib.nullcontext()
    accelerate_autocast = trainer.accelerator.native_amp
    trainer.accelerator.native_amp = accelerate_autocast and autocast  # TRL's loss enters accelerator.autocast()
    routes = record_routing(model) if isinstance(routing, list) else replay_routing(model, routing)
    try:
        with routes as record:  # open through backward: gradient checkpointing re-runs the routers there
            with policy_logps(trainer) as seen, context:
                loss = trainer.compute_loss(model, dict(batch))
            loss.backward()
        if isinstance(routing, list):
            routing.append(record)
    finally:
        trainer.accelerator.native_amp = accelerate_autocast
        trainer._end_loss_pass()
    counted = (batch["completion_mask"] * batch["tool_mask"]).bool()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {
        "logp": seen[0][counted],
        "loss": loss.detach(),
        "grads": {n: None if p.grad is None else full(p.grad) for n, p in trainable},
        "dtypes": {n: [_name(p.dtype), None if p.grad is None else _name(p.grad.dtype)] for n, p in trainable},
    }


# -- judging --------------------------------------------------------------------------------------------------
def atol_ulps(name: str) -> int:
    return ATOL_ULPS_CANCELLING if name.endswith(CANCELLING_SUMS) else ATOL_ULPS


def judge(ours: dict, stock: dict, ref: dict, dtype: torch.dtype) -> dict:
    """Per named quantity: max |ours - ref64|, max |stock - ref64|, atol, mean |ours - ref64|, and whether
    STYLE.md #3 holds. A gradient missing on either side fails its quantity."""
    eps = torch.finfo(dtype).eps
    pairs = [("logp", [r["logp"] for r in (ours, stock, ref)]), ("loss", [r["loss"] for r in (ours, stock, ref)])]
    pairs += [(f"grad:{n}", [r["grads"].get(n) for r in (ours, stock, ref)]) for n in ref["grads"]]
    report = {}
    for name, (got, theirs, exact) in pairs:
        if got is None or theirs is None or exact is None:
            report[name] = {"ok": False, "missing": [t is None for t in (got, theirs, exact)]}
            continue
        exact = exact.double()
        our_err = (got.double() - exact).abs()
        their_err = (theirs.double() - exact).abs().max().item()
        atol = atol_ulps(name) * eps * exact.abs().max().item()
        report[name] = {
            "ours": our_err.max().item(),
            "stock": their_err,
            "atol": atol,
            "mean_ours": our_err.mean().item(),
            "ok": our_err.max().item() <= 2 * their_err + atol,
        }
    return report


# -- one cell -------------------------------------------------------------------------------------------------
def position_reward(completions, **kwargs) -> list[float]:
    """0, 1, 0, 1, ...: the two samples of a prompt (adjacent rows) always differ, so advantages are not zero."""
    return [float(i % 2) for i in range(len(completions))]


def _fp16_autocast(cache_enabled: bool | None = True):
    """``fp16: true`` on a GPU: accelerate runs the loss forward under ``torch.autocast(float16)``. On the CPU
    accelerate 1.15 leaves ``native_amp`` off for fp16 (silently: the run is plain fp32), so fp16 cells put
    CPU fp16 autocast where accelerate's sits, through the Trainer's own hook around ``compute_loss``. No
    GradScaler: one step of a tiny model's loss neither overflows nor underflows in fp16."""
    return torch.autocast("cpu", dtype=torch.float16, cache_enabled=cache_enabled)


def build_trainer(cell: Cell, output_dir: str, tokenizer, num_processes: int = 1):
    from datasets import Dataset

    from tests.rollout.loop_helpers import AddTool
    from tests.trainer.helpers import PROMPTS, SYSTEM, grpo_args, lora_config, user
    from trl_gptoss.testing import tiny_gpt_oss
    from trl_gptoss.trainer import GptOssGRPOTrainer

    fields = dict(
        bf16=cell.autocast == "bf16",
        max_steps=1,
        per_device_train_batch_size=4 // num_processes,
        max_completion_length=16,
        learning_rate=LEARNING_RATE,
        entropy_coef=ENTROPY_COEF,
    )
    if cell.layout == "fsdp2":
        from trl_gptoss.testing.fsdp_cpu import fsdp_args

        fields.update(fsdp_args())
    trainer = GptOssGRPOTrainer(
        tiny_gpt_oss(seed=0, dtype=WEIGHTS[cell.weights], **MODEL_OVERRIDES),
        position_reward,
        args=grpo_args(output_dir, **fields),
        train_dataset=Dataset.from_list([{"prompt": user(PROMPTS[k])} for k in (0, 1)]),
        processing_class=tokenizer,
        tools=[AddTool()],
        rollout_system=SYSTEM,
        peft_config=lora_config() if cell.lora else None,
    )
    if cell.autocast == "fp16":
        trainer.autocast_smart_context_manager = _fp16_autocast
    return trainer


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def train_one_step(trainer) -> dict:
    """One real ``trainer.train()`` step: the logged losses, which trainable tensors moved, their dtypes after."""
    from trl_gptoss.rollout.weights.names import unwrap

    before = {n: full(p).detach().clone() for n, p in unwrap(trainer.model).named_parameters() if p.requires_grad}
    trainer.train()
    after = {n: full(p) for n, p in unwrap(trainer.model_wrapped).named_parameters() if p.requires_grad}
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "moved": {n: bool((after[n].float() != before[n].float()).any()) for n in before},
        "param_dtypes": {n: _name(p.dtype) for n, p in after.items()},
    }


def run_cell(cell: Cell, output_dir: str, tokenizer, num_processes: int = 1, prepare=None, describe=None) -> dict:
    """Train ``cell`` one step, then judge its loss pass. ``prepare(accelerator)`` returns the function that
    readies the stock model the way the trainer's model was prepared (FSDP2); ``describe(trainer)``: extra facts."""
    from trl_gptoss.rollout.weights.names import unwrap

    trainer = build_trainer(cell, output_dir, tokenizer, num_processes)
    step = train_one_step(trainer)
    batch = fixed_batch(tokenizer, num_processes)
    ours_model = trainer.model_wrapped
    bare = unwrap(ours_model)
    config = unwrap(bare, peft=True).config
    state = {name: full(t).detach().clone() for name, t in bare.state_dict().items()}
    ref_net = stock_model(config, state, torch.float64, cell.lora, trainer.temperature)
    routing = []  # ref64's experts for every token, replayed by ours and stock
    ref = loss_pass(trainer, ref_net, batch, routing, autocast=False)
    ours = loss_pass(trainer, ours_model, batch, routing[0])
    stock_net = stock_model(config, state, WEIGHTS[cell.weights], cell.lora, trainer.temperature)
    stock = loss_pass(trainer, prepare(trainer.accelerator)(stock_net) if prepare else stock_net, batch, routing[0])
    facts = describe(trainer) if describe is not None else {}
    trainer.close()
    return {
        "cell": asdict(cell),
        "facts": {**facts, "logp_dtype": _name(ours["logp"].dtype)},
        "step": step,
        "loss_pass": {"loss": ours["loss"].item(), "dtypes": ours["dtypes"]},
        "compare": judge(ours, stock, ref, cell.compute_dtype),
    }
