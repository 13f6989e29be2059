"""``GptOssGRPOTrainer``: TRL's GRPO with trl-gptoss rollouts, exact on-policy ratios and rollout correction.

Hooks over ``GRPOTrainer`` (everything else -- sampler, rewards, advantages, loss types, logging -- is TRL's):

- ``rollout_func`` (TRL's own hook): ``run_rollouts`` on this process's prompts with the configured engine and
  tools; every process first joins the weight push when the engine holds older weights.
- ``_generate``: rewards receive the final answer as ``completions`` (plus ``messages`` etc. as columns).
- ``_compute_loss`` opens a ``LossPass`` that ``_get_per_token_logps_and_entropies`` reads: R3 replay and, on
  the policy's log-probs, the rollout-correction weights and ``policy/ratio_max_abs_dev``. Outside a loss pass
  the same hook is the old-log-prob pass (R3 records there).
- ``create_model_card``: name, base checkpoint, a working Harmony quick start, training curves.
- ``get_batch_samples`` / ``_prepare_inputs`` (``max_staleness=1`` only): read the next update's batch ahead and
  sample it in the background (``trl_gptoss.trainer.overlap``) while this update trains; pushes wait for it.

On-policy rule: ``use_vllm`` stays False, so TRL computes old log-probs only when
``gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0``; otherwise its loss uses
``per_token_logps.detach()`` and the PPO ratio is exactly 1 -- no extra forward.
"""

from __future__ import annotations

import copy
import logging
import textwrap
import time
from pathlib import Path

import torch
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id

import trl_gptoss  # noqa: F401  (registers fa3_sink and gptoss_sequential)
from trl_gptoss.rollout.weight_sync import unwrap
from trl_gptoss.trainer.checks import (
    as_conversation,
    check_dataset,
    check_world,
    checked_reward,
    required_reward_columns,
)
from trl_gptoss.trainer.config import GptOssGRPOConfig
from trl_gptoss.trainer.correction import finalize_metrics, masked_log_ratio, mismatch_stats, rollout_correction
from trl_gptoss.trainer.fsdp_precision import keep_outputs_as_computed
from trl_gptoss.trainer.logprob_head import add_selective_logprobs_head
from trl_gptoss.trainer.loss_pass import LossPass
from trl_gptoss.trainer.master_weights import MasterWeightsGuard
from trl_gptoss.trainer.model_card import card_model_name, rewrite_card
from trl_gptoss.trainer.overlap import BackgroundRollouts, NextBatchPeek
from trl_gptoss.trainer.policy import DropLoadedModelWarning, load_policy, resolve_aux_coef, switch_implementations
from trl_gptoss.trainer.replay import RoutingReplay
from trl_gptoss.trainer.rollouts import (
    ROLLOUT_COLUMNS,
    RolloutBackend,
    build_tools,
    final_answer_completions,
    rollout_config,
    rollouts_to_trl,
)
from trl_gptoss.trainer.sequence_parallel import LocalCollectives, SequenceParallelLoss, check_sequence_parallel
from trl_gptoss.trainer.timing import OptimizerTimer, PhaseTimer

_CITATION = textwrap.dedent("""\
    @article{shao2024deepseekmath,
        title   = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
        author  = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and others},
        year    = 2024,
        eprint  = {arXiv:2402.03300},
    }
    @article{feng2025retool,
        title   = {{ReTool: Reinforcement Learning for Strategic Tool Use in LLMs}},
        author  = {Jiazhan Feng and Shijue Huang and Xingwei Qu and Ge Zhang and Yujia Qin and others},
        year    = 2025,
        eprint  = {arXiv:2504.11536},
    }
    @article{xiao2024attentionsinks,
        title   = {{Efficient Streaming Language Models with Attention Sinks}},
        author  = {Guangxuan Xiao and Yuandong Tian and Beidi Chen and Song Han and Mike Lewis},
        year    = 2024,
        eprint  = {arXiv:2309.17453},
    }""")


logger = logging.getLogger(__name__)


class GptOssGRPOTrainer(GRPOTrainer):
    """GRPO for GPT-OSS: multi-turn Harmony tool rollouts, exact on-policy ratio, verl-style rollout correction.

    ``model``: a model id/path (loaded with ``args.attn_implementation`` / ``args.experts_implementation``) or
    a ``GptOssForCausalLM`` (switched to them). ``reward_funcs`` follow TRL's signature and also receive the
    columns ``final_answer``, ``messages``, ``num_turns``, ``num_tool_calls``, ``num_tool_errors``,
    ``stop_reason``. Prompts are conversations, or plain text (TRL's "standard" format: one user message).
    ``tools`` overrides ``args.tool_names`` with tool instances; ``rollout_system`` (a
    ``trl_gptoss.harmony.SystemContent``) replaces Harmony's default system message in every prompt.
    """

    _tag_names = ["trl", "grpo", "gpt-oss", "trl-gptoss"]
    _name = "GPT-OSS GRPO (trl-gptoss)"
    _paper = {
        "title": "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
        "id": "2402.03300",
        "citation": _CITATION,
    }

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GptOssGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        tools=None,
        rollout_system=None,
        **kwargs,
    ):
        args = args if args is not None else GptOssGRPOConfig("trl-gptoss-grpo")
        if not isinstance(args, GptOssGRPOConfig):
            raise ValueError(f"args must be a GptOssGRPOConfig, got {type(args).__name__}")
        if reward_funcs is not None:
            reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
            required = {c for f in reward_funcs for c in required_reward_columns(f)} - set(ROLLOUT_COLUMNS)
            check_dataset(train_dataset, sorted(required))
            reward_funcs = [checked_reward(f) for f in reward_funcs]
        resolve_aux_coef(args, model)
        model = load_policy(model, args)
        trl_logger = logging.getLogger(GRPOTrainer.__module__)
        quiet = DropLoadedModelWarning()
        trl_logger.addFilter(quiet)
        try:
            super().__init__(
                model, reward_funcs, args=args, train_dataset=train_dataset, processing_class=processing_class, **kwargs
            )
        finally:
            trl_logger.removeFilter(quiet)
        check_world(self.accelerator.num_processes)
        keep_outputs_as_computed(self.accelerator)  # before prepare: FSDP2 would cast the log-probs to bf16
        if self.ref_model is not None:  # TRL built it from the policy's path: same implementations
            switch_implementations(self.ref_model, args)
        if args.logprobs_implementation == "selective_logprobs":
            for model_ in (self.model, self.ref_model):
                if model_ is not None:  # TRL's fused head was added to the bare model; ours replaces it there
                    add_selective_logprobs_head(unwrap(model_, peft=True), self.temperature, args.cast_lm_head_to_fp32)
        self.sp_loss = (
            SequenceParallelLoss(check_sequence_parallel(args, self.model.config)) if args.sp_size > 1 else None
        )
        self.rollout_tools = list(tools) if tools is not None else build_tools(args.tool_names)
        self.rollout_system = rollout_system
        self.rollout_backend = RolloutBackend(args, self.accelerator.unwrap_model(self.model), self._tokenizer)
        self.rollout_func = self._rollout_batch
        self.routing_replay = RoutingReplay() if args.routing_replay else None
        self.timer = PhaseTimer(self)
        self.add_callback(OptimizerTimer(self.timer))
        self.add_callback(MasterWeightsGuard(self))  # bf16 weights in a torch optimizer at an lr they round away
        self.last_rollouts = []  # the latest batch of this process, for inspection; no hook reads it
        self.last_weight_version = None  # global step whose weights sampled last_rollouts
        self._pushed_step = None  # global step whose weights the engine holds (None: not pushed yet)
        self._loss_pass: LossPass | None = None
        # max_staleness=1: the next batch's rollouts run in the background while this step trains
        self.background_rollouts = BackgroundRollouts() if args.max_staleness else None
        self._batch_peek = NextBatchPeek()
        self._next_prompts = None  # prompts of the next generation batch, read ahead, not started yet

    # -- generation -------------------------------------------------------------------------------------
    def _push_weights_if_stale(self) -> None:
        """Before sampling, give the engine the weights of the current optimizer step (also the first rollout
        after a resume). The push is collective -- every process joins the gathers of sharded (FSDP2) weights,
        rank 0 sends -- and all processes wait, so none samples from weights being replaced."""
        if self._pushed_step == self.state.global_step:
            return
        if self.background_rollouts is not None:  # never replace weights under a running generation: wait for
            self.background_rollouts.wait()  # this process's job, then for every process's
            self.accelerator.wait_for_everyone()
        with self.timer.phase("weight_push"):
            self.rollout_backend.push(self.accelerator.unwrap_model(self.model))
            self.accelerator.wait_for_everyone()
        self._pushed_step = self.state.global_step

    def _rollout_batch(self, prompts, trainer) -> dict:
        prompts = [as_conversation(p) for p in prompts]
        job = None
        if self.background_rollouts is not None and self.model.training:
            start = time.perf_counter()
            job = self.background_rollouts.take(prompts)  # waits for the job sampling exactly these prompts
            if job is not None:
                self.timer.record("generation", time.perf_counter() - start)  # what this step waited
                self.timer.record("generation_background", job.seconds)
        if job is None:
            rollouts, version = self._generate_now(prompts), self.state.global_step
        else:
            rollouts, version = job.rollouts, job.weight_version
        self.timer.record("tool_calls", sum(r.timings.get("tool_s", 0.0) for r in rollouts))
        self.last_rollouts = rollouts
        self.last_weight_version = version
        self._log_rollout_metrics(rollouts)
        if self.background_rollouts is not None:
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["rollout/staleness"].append(float(self.state.global_step - version))
        return rollouts_to_trl(rollouts)

    def _generate_now(self, prompts: list) -> list:
        from trl_gptoss.rollout.loop import run_rollouts

        self._push_weights_if_stale()
        with self.timer.phase("generation"):
            return run_rollouts(self.rollout_backend.engine, prompts, **self._rollout_kwargs(self.state.global_step))

    def _rollout_kwargs(self, step: int) -> dict:
        """Everything ``run_rollouts`` needs beside the engine and prompts, for the batch trained at ``step``."""
        config = rollout_config(self.args, step, self.accelerator.process_index, system=self.rollout_system)
        return {"tokenizer": self._tokenizer, "tools": self.rollout_tools, "config": config}

    def _start_next_rollouts(self, prompts: list) -> None:
        """max_staleness=1: push this step's weights (between two generations), then sample the next batch
        in the background with them while this step trains."""
        from trl_gptoss.rollout.loop import arun_rollouts

        self._push_weights_if_stale()
        version = self.state.global_step
        engine, kwargs = self.rollout_backend.engine, self._rollout_kwargs(version + 1)
        self.background_rollouts.start(prompts, version, lambda: arun_rollouts(engine, prompts, **kwargs))

    def _generate(self, prompts):
        outputs = list(super()._generate(prompts))
        answers = outputs[5]["final_answer"]  # extra field of the rollout_func output
        conversational = bool(prompts) and not isinstance(prompts[0], str)
        outputs[3] = final_answer_completions(answers, conversational)  # completions the rewards see
        return tuple(outputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self.timer.phase("rewards"):
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def _log_rollout_metrics(self, rollouts) -> None:
        mode = "train" if self.model.training else "eval"
        device = self.accelerator.device
        local = torch.tensor(
            [[r.num_turns, r.num_tool_calls, r.num_tool_errors, r.final_answer is not None] for r in rollouts],
            dtype=torch.float32,
            device=device,
        )
        stats = self.accelerator.gather(local)
        calls = stats[:, 1].sum().item()
        self._metrics[mode]["rollout/num_turns_mean"].append(stats[:, 0].mean().item())
        self._metrics[mode]["tools/call_frequency"].append(calls / max(len(stats), 1))
        self._metrics[mode]["tools/failure_frequency"].append(stats[:, 2].sum().item() / calls if calls else 0.0)
        self._metrics[mode]["rollout/final_answer_fraction"].append(stats[:, 3].mean().item())

    # -- loss-side hooks --------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        if self.routing_replay is not None:
            self.routing_replay.arm()
        output = super()._generate_and_score_completions(inputs)
        if self.routing_replay is not None:
            output["routing_indices"] = self.routing_replay.take()
        return output

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """max_staleness=1: also read the next update's first batch when that update starts a generation, so
        its rollouts can start while this update trains (the item is handed back at the next call)."""
        if self.background_rollouts is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches, num_items = super().get_batch_samples(self._batch_peek.read(epoch_iterator), num_batches, device)
        self._next_prompts = None
        generate_every = self.args.steps_per_generation * self.num_iterations
        next_generates = (self._step + len(batches)) % generate_every == 0
        if next_generates and self.state.global_step + 1 < self.state.max_steps:
            item = self._batch_peek.peek(epoch_iterator)
            if item is not None:
                self._next_prompts = [as_conversation(copy.deepcopy(row["prompt"])) for row in item]
        return batches, num_items

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)  # generates this update's batch when it is due
        if self._next_prompts is not None and self.model.training:
            prompts, self._next_prompts = self._next_prompts, None
            self._start_next_rollouts(prompts)
        self.timer.mark("inputs_ready")
        return inputs

    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.timer.since("inputs_ready", "loss_forward_backward")
            return loss
        finally:
            self._end_loss_pass()  # after backward: replay hooks were needed until gradient checkpointing re-ran

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.sp_loss is None or not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self.sp_loss(self, model, inputs)

    def _compute_loss(self, model, inputs, logps: torch.Tensor | None = None, entropies: torch.Tensor | None = None):
        """TRL's loss on ``inputs``; ``logps, entropies [B, T]``: the policy's completion log-probs and entropies
        when already computed (SP). Opens the ``LossPass`` the log-prob hook reads."""
        self._end_loss_pass()
        self._loss_pass = LossPass(dict(inputs), logps=logps, entropies=entropies)
        try:
            return super()._compute_loss(model, self._loss_pass.inputs)
        finally:
            if not self.model.training:
                self._end_loss_pass()

    def compute_loss_from_logps(
        self, model, inputs, logps: torch.Tensor, entropies: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The loss of one micro-batch from log-probs computed by the SP runner, with this process's metrics
        kept local: only the owner rank runs it while its peers are inside the runner's collectives."""
        accelerator, self.accelerator = self.accelerator, LocalCollectives(self.accelerator)
        try:
            return self._compute_loss(model, inputs, logps=logps, entropies=entropies)
        finally:
            self.accelerator = accelerator

    def _end_loss_pass(self) -> None:
        loss_pass, self._loss_pass = self._loss_pass, None
        if loss_pass is not None:
            loss_pass.close()

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, *args, **kwargs
    ):
        loss_pass = self._loss_pass
        if loss_pass is None or not loss_pass.take_policy_call():
            with self.timer.phase("old_logprobs"):
                return self._logps_outside_loss(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, *args, **kwargs
                )
        if loss_pass.logps is not None:  # the SP runner already computed them
            self._correct_and_log(loss_pass.inputs, loss_pass.logps)
            entropies = loss_pass.entropies
            return (
                loss_pass.logps,
                torch.full_like(loss_pass.logps, float("nan")) if entropies is None else entropies,
                None,
            )
        recorded = loss_pass.inputs.get("routing_indices")
        if recorded is not None:  # training: gradient checkpointing re-runs routers in backward, so the
            loss_pass.scope.enter_context(self.routing_replay.replay(model, recorded))  # scope outlives it
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, *args, **kwargs
        )
        self._correct_and_log(loss_pass.inputs, logps)
        return logps, entropies, aux

    def _logps_outside_loss(self, model, *args, **kwargs):
        """Old-policy (and reference) log-probs; R3 records the routing of the old-policy pass."""
        parent = super()._get_per_token_logps_and_entropies
        if self.routing_replay is not None and self.routing_replay.armed:
            return self.routing_replay.record(parent, model, *args, **kwargs)
        return parent(model, *args, **kwargs)

    def _correct_and_log(self, inputs: dict, logps: torch.Tensor) -> None:
        """Scale the advantages by the rollout-correction weights and log the mismatch metrics.

        Every TRL loss multiplies the advantage into each token's term after the clip (``-min(c1 A, c2 A)``,
        ``-c A logp``, ...), so with weights ``w >= 0``, ``A * w`` gives exactly ``w * per_token_loss`` --
        verl's placement of the correction -- without reimplementing the loss.
        """
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        ratio_dev = ((logps.detach() - old).exp() - 1).abs() * mask
        self._metrics[mode]["policy/ratio_max_abs_dev"].append(
            self.accelerator.gather(ratio_dev.max() if ratio_dev.numel() else logps.new_zeros(())).max().item()
        )
        rollout_logps = inputs.get("sampling_per_token_logps")
        if rollout_logps is None:
            return
        preset = self.args.correction_preset
        log_ratio = masked_log_ratio(old, rollout_logps, mask)
        correction = rollout_correction(log_ratio, mask, preset, self.args.correction_thresholds())
        sums, maxes = mismatch_stats(old, rollout_logps, mask, correction, log_ratio)
        sums = self.accelerator.reduce(sums, reduction="sum")
        maxes = self.accelerator.gather(maxes[None]).max(dim=0).values
        for name, value in finalize_metrics(sums, maxes).items():
            self._metrics[mode][f"rollout_corr/{name}"].append(value)
        if preset.applies_weights:
            advantages = inputs["advantages"]
            advantages = advantages[:, None] if advantages.dim() == 1 else advantages
            inputs["advantages"] = advantages * correction.weights.to(advantages.dtype)

    # -- lifecycle --------------------------------------------------------------------------------------
    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        model_name = model_name or card_model_name(self.args)
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        readme = Path(self.args.output_dir, "README.md")
        if readme.is_file():
            rewrite_card(
                readme,
                model_id=self.args.hub_model_id or model_name,
                base=get_config_model_id(self.accelerator.unwrap_model(self.model).config),
                plots=sorted(Path(self.args.output_dir).glob("plots/*.png")),
            )

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self._pushed_step = None  # a later train()/resume re-pushes before its first rollout
            self._next_prompts, self._batch_peek = None, NextBatchPeek()
            if self.background_rollouts is not None:  # nothing sampled for this run outlives it, nor its thread
                self.background_rollouts.close()

    def close(self) -> None:
        """Stop the background generation and a vLLM server this trainer started (also done at exit)."""
        if self.background_rollouts is not None:
            self.background_rollouts.close()
        self.rollout_backend.close()
