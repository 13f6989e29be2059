"""``GptOssGRPOTrainer``: TRL's GRPO with trl-gptoss rollouts, exact on-policy ratios and rollout correction.

Hooks over ``GRPOTrainer`` (everything else -- sampler, rewards, advantages, loss types, logging -- is TRL's):

- ``rollout_func`` (TRL's own hook, set after ``__init__``): ``run_rollouts`` on this process's prompts with
  the configured engine and tools; the engine first gets the current weights when it has older ones.
- ``_generate``: rewards receive the final answer as ``completions`` (plus ``messages`` etc. as columns).
- ``_get_per_token_logps_and_entropies``: R3 record (old-log-prob pass) / replay (loss pass), and in the loss
  pass the rollout-correction weights and ``policy/ratio_max_abs_dev``.
- ``create_model_card``: tags, citations, training curves.

On-policy rule: ``use_vllm`` stays False, so TRL computes old log-probs only when
``gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0``; otherwise its loss uses
``per_token_logps.detach()`` and the PPO ratio is exactly 1 -- no extra forward.
"""

from __future__ import annotations

import contextlib
import logging
import textwrap
from pathlib import Path

import torch
from transformers import AutoConfig
from trl import GRPOTrainer

import trl_gptoss  # noqa: F401  (registers fa3_sink and gptoss_sequential)
from trl_gptoss.trainer.checks import check_dataset, checked_reward, required_reward_columns
from trl_gptoss.trainer.config import UNSET_AUX_COEF, GptOssGRPOConfig
from trl_gptoss.trainer.correction import finalize_metrics, masked_log_ratio, mismatch_stats, rollout_correction
from trl_gptoss.trainer.replay import RoutingReplay
from trl_gptoss.trainer.rollouts import (
    ROLLOUT_COLUMNS,
    RolloutBackend,
    build_tools,
    final_answer_completions,
    rollout_config,
    rollouts_to_trl,
)
from trl_gptoss.trainer.sequence_parallel import SequenceParallelLoss, check_sequence_parallel

logger = logging.getLogger(__name__)

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


class GptOssGRPOTrainer(GRPOTrainer):
    """GRPO for GPT-OSS: multi-turn Harmony tool rollouts, exact on-policy ratio, verl-style rollout correction.

    ``model``: a model id/path (loaded with ``args.attn_implementation`` / ``args.experts_implementation``) or
    a ``GptOssForCausalLM`` (switched to them). ``reward_funcs`` follow TRL's signature and also receive the
    columns ``final_answer``, ``messages``, ``num_turns``, ``num_tool_calls``, ``num_tool_errors``,
    ``stop_reason``. ``tools`` overrides ``args.tool_names`` with tool instances; ``rollout_system`` (a
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
        reward_funcs,
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
        model = _prepare_model(model, args)
        reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        required = {c for f in reward_funcs for c in required_reward_columns(f)} - set(ROLLOUT_COLUMNS)
        check_dataset(train_dataset, sorted(required))
        _resolve_aux_coef(args, model)
        super().__init__(
            model,
            [checked_reward(f) for f in reward_funcs],
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        self._sp_logps = None
        self.sp_loss = (
            SequenceParallelLoss(check_sequence_parallel(args, self.model.config)) if args.sp_size > 1 else None
        )
        self.rollout_tools = list(tools) if tools is not None else build_tools(args.tool_names)
        self.rollout_system = rollout_system
        self.rollout_backend = RolloutBackend(args, self.accelerator.unwrap_model(self.model), self._tokenizer)
        self.rollout_func = self._rollout_batch
        self._pushed_step = None  # global step whose weights the engine holds (None: not pushed yet)
        self._last_rollouts = []
        self._loss_inputs = None
        self._step_scope = None  # an ExitStack while training_step runs
        self.routing_replay = RoutingReplay() if args.routing_replay else None

    # -- generation -------------------------------------------------------------------------------------
    def _push_weights_if_stale(self) -> None:
        """Before sampling, give the engine the weights of the current optimizer step (also the first rollout
        after a resume). All processes wait, so none samples from weights being replaced."""
        if self._pushed_step == self.state.global_step:
            return
        if self.accelerator.is_main_process or self.args.rollout_backend == "transformers":
            self.rollout_backend.engine.push_weights(self.accelerator.unwrap_model(self.model))
        self.accelerator.wait_for_everyone()
        self._pushed_step = self.state.global_step

    def _rollout_batch(self, prompts, trainer) -> dict:
        from trl_gptoss.rollout.loop import run_rollouts

        self._push_weights_if_stale()
        config = rollout_config(
            self.args, self.state.global_step, self.accelerator.process_index, system=self.rollout_system
        )
        rollouts = run_rollouts(
            self.rollout_backend.engine, prompts, tokenizer=self._tokenizer, tools=self.rollout_tools, config=config
        )
        self._last_rollouts = rollouts
        self._log_rollout_metrics(rollouts)
        return rollouts_to_trl(rollouts)

    def _generate(self, prompts):
        outputs = list(super()._generate(prompts))
        outputs[3] = final_answer_completions(self._last_rollouts)  # completions the rewards see
        return tuple(outputs)

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

    def training_step(self, model, inputs, num_items_in_batch=None):
        with contextlib.ExitStack() as self._step_scope:  # replay hooks live through forward AND backward
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._step_scope = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.sp_loss is None or not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self.sp_loss(self, model, inputs)

    def _compute_loss(self, model, inputs):
        # A shallow copy: the hook below replaces "advantages" by per-token corrected ones, and TRL reuses the
        # buffered batch for every iteration.
        self._loss_inputs = dict(inputs)
        try:
            return super()._compute_loss(model, self._loss_inputs)
        finally:
            self._loss_inputs = None

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, *args, **kwargs
    ):
        inputs = self._loss_inputs
        in_loss = inputs is not None and compute_entropy
        if in_loss and self._sp_logps is not None:  # the SP runner already computed them (no entropies)
            logps = self._sp_logps
            self._correct_and_log(inputs, logps)
            return logps, torch.full_like(logps, float("nan")), None
        if not in_loss and self.routing_replay is not None and self.routing_replay.armed:
            return self.routing_replay.record(
                super()._get_per_token_logps_and_entropies,
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                *args,
                **kwargs,
            )
        recorded = inputs.get("routing_indices") if in_loss else None
        replay = contextlib.nullcontext()
        if recorded is not None:
            replay = self.routing_replay.replay(model, recorded)
            if self._step_scope is not None:  # training: gradient checkpointing re-runs routers in backward
                self._step_scope.enter_context(replay)
                replay = contextlib.nullcontext()
        with replay:
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, *args, **kwargs
            )
        if in_loss:
            self._correct_and_log(inputs, logps)
        return logps, entropies, aux

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
        log_ratio = masked_log_ratio(old, rollout_logps, mask)
        correction = rollout_correction(
            log_ratio, mask, self.args.rollout_correction, self.args.correction_thresholds()
        )
        sums, maxes = mismatch_stats(old, rollout_logps, mask, correction, log_ratio)
        sums = self.accelerator.reduce(sums, reduction="sum")
        maxes = self.accelerator.gather(maxes[None]).max(dim=0).values
        for name, value in finalize_metrics(sums, maxes).items():
            self._metrics[mode][f"rollout_corr/{name}"].append(value)
        if self.args.rollout_correction != "none":
            advantages = inputs["advantages"]
            advantages = advantages[:, None] if advantages.dim() == 1 else advantages
            inputs["advantages"] = advantages * correction.weights.to(advantages.dtype)

    # -- lifecycle --------------------------------------------------------------------------------------
    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        readme = Path(self.args.output_dir, "README.md")
        plots = sorted(Path(self.args.output_dir).glob("plots/*.png"))
        if readme.is_file() and plots:
            lines = ["", "## Training curves", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots]
            readme.write_text(readme.read_text() + "\n".join(lines) + "\n")

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self._pushed_step = None  # a later train()/resume re-pushes before its first rollout

    def close(self) -> None:
        """Stop a vLLM server this trainer started (also done at interpreter exit)."""
        self.rollout_backend.close()


def _prepare_model(model, args: GptOssGRPOConfig):
    """Load with, or switch to, the configured attention and experts implementations."""
    if isinstance(model, str):
        init = dict(args.model_init_kwargs or {})
        init.setdefault("attn_implementation", args.attn_implementation)
        init.setdefault("experts_implementation", args.experts_implementation)
        args.model_init_kwargs = init
        return model
    if model.config._attn_implementation != args.attn_implementation:
        model.set_attn_implementation(args.attn_implementation)
    if getattr(model.config, "_experts_implementation", None) != args.experts_implementation:
        model.set_experts_implementation(args.experts_implementation)
    return model


def _resolve_aux_coef(args: GptOssGRPOConfig, model) -> None:
    """Default 0.0: GPT-OSS checkpoints declare 0.9, which TRL would otherwise add to the RL loss."""
    if args.router_aux_loss_coef is not UNSET_AUX_COEF:
        return
    config = AutoConfig.from_pretrained(model) if isinstance(model, str) else model.config
    declared = getattr(config.get_text_config(), "router_aux_loss_coef", None)
    if declared:
        logger.warning(
            "the checkpoint declares router_aux_loss_coef=%s; trl-gptoss trains with 0.0 (no "
            "load-balancing loss in RL). Set router_aux_loss_coef explicitly to use it.",
            declared,
        )
    args.router_aux_loss_coef = 0.0
