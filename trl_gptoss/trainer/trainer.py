"""``GptOssGRPOTrainer``: TRL's GRPO with trl-gptoss rollouts, exact on-policy ratios and rollout correction.

Each hook over ``GRPOTrainer`` is one call into the object that owns its concern: the ``Sampler`` (which weights
sample each batch, when a push may land), the ``LossPass`` (R3 replay, rollout correction, the SP owner's local
collectives), ``evaluate_held_out`` (mean@k / pass@k / maj@k). Everything else is TRL's. On-policy rule:
``use_vllm`` stays False, so TRL computes old log-probs only when ``gradient_accumulation_steps % (steps_per_generation
* num_iterations) != 0``; otherwise its loss uses ``per_token_logps.detach()`` and the PPO ratio is exactly 1.
"""

from __future__ import annotations

from pathlib import Path

import torch
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id

import trl_gptoss  # noqa: F401  (registers fa3_sink and gptoss_sequential)
from trl_gptoss.long_context import enable_from_config
from trl_gptoss.long_context.rules import check_offload_fits_host
from trl_gptoss.tools import build_tools
from trl_gptoss.trainer.checks import check_world, checked_rewards
from trl_gptoss.trainer.config import GptOssGRPOConfig
from trl_gptoss.trainer.final_save import save_gathered, writes_no_weights
from trl_gptoss.trainer.fsdp_precision import keep_outputs_as_computed
from trl_gptoss.trainer.held_out import best_model_metric_problem, evaluate_held_out
from trl_gptoss.trainer.learning_signal import LearningSignalCallback
from trl_gptoss.trainer.logprob_head import replace_fused_heads
from trl_gptoss.trainer.loss_pass import LocalCollectives, LossPass
from trl_gptoss.trainer.master_weights import MasterWeightsGuard
from trl_gptoss.trainer.model_card import PAPER, card_model_name, rewrite_card
from trl_gptoss.trainer.policy import load_policy, model_init_warning_dropped, resolve_aux_coef, switch_implementations
from trl_gptoss.trainer.replay import flip_fraction, routing_replay_for
from trl_gptoss.trainer.resume import StopAndResume
from trl_gptoss.trainer.rollouts import final_answer_completions, rollout_metrics, rollouts_to_trl
from trl_gptoss.trainer.sampling import Sampler
from trl_gptoss.trainer.sequence_parallel import SequenceParallelLoss
from trl_gptoss.trainer.timing import OptimizerTimer, PhaseTimer


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
    _paper = PAPER

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
        if problem := best_model_metric_problem(args):  # before the model loads
            raise ValueError(problem)
        reward_funcs = checked_rewards(reward_funcs, train_dataset, kwargs.get("eval_dataset"), args.reward_weights)
        resolve_aux_coef(args, model)
        check_offload_fits_host(args, model)  # before the weights load
        model = load_policy(model, args)
        long_context = enable_from_config(model, args)  # before PEFT and FSDP2 wrap the decoder layers
        with model_init_warning_dropped():
            super().__init__(
                model, reward_funcs, args=args, train_dataset=train_dataset, processing_class=processing_class, **kwargs
            )
        self.long_context = long_context  # the layers' long-context handle (None when the options are off)
        check_world(self.accelerator.num_processes)
        keep_outputs_as_computed(self.accelerator)  # before prepare: FSDP2 would cast the log-probs to bf16
        switch_implementations(self.ref_model, args)  # TRL built it from the policy's path (None when beta is 0)
        replace_fused_heads(args, (self.model, self.ref_model), self.temperature)
        self.sp_loss = SequenceParallelLoss.for_config(args, self.model.config)  # None unless sp_size > 1
        self.routing_replay = routing_replay_for(args, self.model)  # None unless routing_replay is on
        self.timer = PhaseTimer(self)
        self.add_callback(OptimizerTimer(self.timer))
        self.add_callback(MasterWeightsGuard(self))  # bf16 weights in a torch optimizer at an lr they round away
        self.add_callback(StopAndResume(args))  # SIGTERM stops as Ctrl-C; partial checkpoints set aside
        self.add_callback(LearningSignalCallback())  # a run that cannot learn is said, once per cause
        self.sampler = Sampler(
            args,
            lambda: self.accelerator.unwrap_model(self.model),
            self._tokenizer,
            tools=list(tools) if tools is not None else build_tools(args.tool_names),
            system=rollout_system,
            world=self.accelerator,
            record=self.timer.record,
        )
        self.rollout_func = self._rollout_batch
        self.held_out_results: list = []  # the latest evaluation's per-problem results (evaluate())
        self._loss_pass: LossPass | None = None

    @property
    def accelerator(self):
        """Accelerate's object -- except inside the loss of one SP micro-batch, which only its owner rank computes
        while its peers are inside the runner's collectives: there TRL's metric gathers read the ``LossPass``'s
        local collectives. The accelerator itself is never replaced."""
        loss_pass = self.__dict__.get("_loss_pass")
        return loss_pass.collectives if loss_pass is not None and loss_pass.local else self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator) -> None:  # set once, by Trainer.create_accelerator_and_postprocess
        self._accelerator = accelerator

    # -- generation: the Sampler's ------------------------------------------------------------------------
    def _rollout_batch(self, prompts, trainer) -> dict:
        batch = self.sampler.sample(prompts, self.state.global_step, train=self.model.training)
        metrics = rollout_metrics(batch.rollouts, self.accelerator)
        if self.routing_replay is not None and self.routing_replay.allow_missing:  # R3: the engine's routes
            metrics.update(self.routing_replay.keep(batch.rollouts, self.accelerator))
        if self.sampler.overlaps:
            metrics["rollout/staleness"] = float(self.state.global_step - batch.version)
        self._log_metrics(metrics)
        return rollouts_to_trl(batch.rollouts)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        fetch, step = super().get_batch_samples, self._step
        return self.sampler.read_batches(fetch, epoch_iterator, num_batches, device, micro_step=step, state=self.state)

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)  # generates this update's batch when it is due
        if self.model.training:
            self.sampler.start_read_ahead(self.state.global_step)
        self.timer.mark("inputs_ready")
        return inputs

    def _generate(self, prompts):
        outputs = list(super()._generate(prompts))
        answers = outputs[5]["final_answer"]  # extra field of the rollout_func output
        conversational = bool(prompts) and not isinstance(prompts[0], str)
        outputs[3] = final_answer_completions(answers, conversational)  # completions the rewards see
        return tuple(outputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        with self.timer.phase("rewards"):
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        """Held-out mean@k / pass@k / maj@k through the ``Sampler`` (``trl_gptoss.trainer.held_out``); no
        ``eval_loss`` (``best_model_metric_problem`` says why and refuses a ``metric_for_best_model`` needing it)."""
        return evaluate_held_out(self, eval_dataset, metric_key_prefix)

    # -- loss-side hooks ----------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        if self.routing_replay is not None:
            self.routing_replay.arm()
        output = super()._generate_and_score_completions(inputs)
        if self.routing_replay is not None:
            output["routing_indices"] = self.routing_replay.take(output)
        return output

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

    def _compute_loss(self, model, inputs, logps=None, entropies=None, collectives=None):
        """TRL's loss on ``inputs``; ``logps, entropies [B, T]``: the policy's completion log-probs and entropies
        when already computed (SP), with ``collectives`` for its metrics. Opens the ``LossPass`` the log-prob
        hook reads."""
        self._end_loss_pass()
        collectives = collectives if collectives is not None else self.accelerator
        self._loss_pass = LossPass(dict(inputs), collectives, logps=logps, entropies=entropies)
        try:
            return super()._compute_loss(model, self._loss_pass.inputs)
        finally:
            if not self.model.training:
                self._end_loss_pass()

    def compute_loss_from_logps(self, model, inputs, logps: torch.Tensor, entropies=None) -> torch.Tensor:
        """The loss of one micro-batch from log-probs computed by the SP runner, with this process's metrics
        kept local: only the owner rank runs it while its peers are inside the runner's collectives."""
        local = LocalCollectives(self.accelerator)
        try:
            return self._compute_loss(model, inputs, logps=logps, entropies=entropies, collectives=local)
        finally:
            self._end_loss_pass()  # the runner has run backward: nothing of this pass is needed any more

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
            self._log_metrics(loss_pass.correct(loss_pass.logps, self.args))
            entropies = loss_pass.entropies
            entropies = torch.full_like(loss_pass.logps, float("nan")) if entropies is None else entropies
            return loss_pass.logps, entropies, None
        recorded, routed = loss_pass.inputs.get("routing_indices"), None
        if recorded is not None:  # training: gradient checkpointing re-runs routers in backward, so the
            routed = loss_pass.scope.enter_context(self.routing_replay.replay(model, recorded))  # scope outlives it
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, *args, **kwargs
        )
        self._log_metrics(loss_pass.correct(logps, self.args))
        if routed is not None and routed.allow_missing:  # R3: how often the trainer's router disagrees
            self._log_metrics({"rollout/route_flip_fraction": flip_fraction([routed], loss_pass.collectives)})
        return logps, entropies, aux

    def _logps_outside_loss(self, model, *args, **kwargs):
        """Old-policy (and reference) log-probs; R3 records the routing of the old-policy pass."""
        parent = super()._get_per_token_logps_and_entropies
        if self.routing_replay is not None and self.routing_replay.armed and model is self.model:
            return self.routing_replay.record(parent, model, *args, **kwargs)
        return parent(model, *args, **kwargs)

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        mode = "train" if self.model.training else "eval"
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)

    # -- lifecycle ----------------------------------------------------------------------------------------
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
            self.sampler.end_run()  # nothing sampled for this run outlives it; a resume pushes afresh

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """transformers' save, except the final one under sharded FSDP checkpoints, where it writes no weights
        (``final_save``); a checkpoint's own save stays transformers' (``.distcp`` shards, what resuming reads)."""
        if _internal_call or not writes_no_weights(self):
            return super().save_model(output_dir, _internal_call)
        save_gathered(self, output_dir if output_dir is not None else self.args.output_dir)
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def close(self) -> None:
        """Stop the background generation and a vLLM server this trainer started (also done at exit)."""
        self.sampler.close()
