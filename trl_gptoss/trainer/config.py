"""``GptOssGRPOConfig``: TRL's ``GRPOConfig`` plus what TRL lacks (rollout engine, R3, SP, geometric rejection).

One vocabulary (gmpo's rule): where TRL already has a field with our meaning we re-default it and honour it --
``vllm_importance_sampling_*`` drives rollout correction, ``max_tool_calling_iterations`` bounds the tool loop --
and TRL fields the trainer cannot honour are refused when set, never silently ignored.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import ClassVar

from trl import GRPOConfig

from trl_gptoss import FA3_SINK
from trl_gptoss.rollout.config import MAX_TURNS
from trl_gptoss.trainer import fields as check
from trl_gptoss.trainer.correction import (
    PRESETS,
    TRL_IS_MODES,
    CorrectionPreset,
    CorrectionThresholds,
    preset_from_trl,
    trl_fields_of,
)
from trl_gptoss.trainer.logprob_head import LOGPROBS_IMPLEMENTATIONS
from trl_gptoss.trainer.refused import refused_parent_fields
from trl_gptoss.trainer.sampling.engines import ENGINE_KINDS

ROLLOUT_BACKENDS = tuple(ENGINE_KINDS)  # the kinds shipped; a kind registered later is accepted as well


class _UnsetZero(float):
    """The default ``router_aux_loss_coef`` (0.0), distinguishable from a 0.0 the user chose, so the trainer
    warns only when it silently overrides the checkpoint's coefficient."""

    def __repr__(self):
        return "0.0"


UNSET_AUX_COEF = _UnsetZero(0.0)

# Deprecated trl-gptoss names (one release) -> the TRL field that now carries the meaning.
_DEPRECATED = {
    "max_turns": "max_tool_calling_iterations (= max_turns - 1)",
    "rollout_correction": "vllm_importance_sampling_correction/_mode and rollout_geometric_rejection",
    "rollout_is_threshold": "vllm_importance_sampling_clip_max",
    "rollout_is_threshold_lower": "vllm_importance_sampling_clip_min",
}


@dataclass
class GptOssGRPOConfig(GRPOConfig):
    """GRPO for GPT-OSS on the trl-gptoss rollout layer (see docs/trainer.md for every field and metric).

    Generation never goes through TRL's ``use_vllm`` path: ``rollout_backend`` picks the trl-gptoss engine
    (``vllm serve`` servers over HTTP, or in-process transformers) and the multi-turn Harmony tool loop.
    """

    # More types a YAML value may have than the annotation says; ``__post_init__`` maps them (the job's YAML type
    # check reads this): ``routing_replay: true / false`` mean ``old_logprob`` / ``off``, as before the modes had names.
    YAML_ALSO: ClassVar[dict[str, tuple[type, ...]]] = {"routing_replay": (bool,)}

    # -- TRL fields, re-defaulted (their meaning is TRL's) --------------------------------------------------
    max_tool_calling_iterations: int | None = field(
        default=7,
        metadata={
            "help": "Most tool calls answered per conversation (TRL's field; each call starts a new assistant "
            "turn, so a conversation has at most this + 1 turns; at most 999). None: bounded by max_completion_length "
            "(and the rollout loop's 1000 turns)."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={
            "help": "Rollout correction of the engine-vs-trainer mismatch (TRL's field, applied to every "
            "rollout backend): token_truncate, token_mask, sequence_truncate or sequence_mask. "
            "vllm_importance_sampling_correction=False turns the weights off (metrics stay)."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=2.0, metadata={"help": "Upper bound of the IS ratio: truncation cap or mask bound (TRL's field)."}
    )
    # -- what TRL lacks --------------------------------------------------------------------------------------
    rollout_backend: str = field(
        default="vllm_server",
        metadata={
            "help": f"Rollout engine, one of {ROLLOUT_BACKENDS}: 'vllm_server' samples from `vllm serve` "
            "servers (weights pushed after every optimizer step); 'transformers' samples in-process "
            "from the trained model itself."
        },
    )
    rollout_server_url: list[str] | None = field(
        default=None,
        metadata={
            "help": "Base URL(s) of running vLLM servers (e.g. http://127.0.0.1:8000; several for data-parallel "
            "replicas). None starts one on this machine serving the model (vllm_server backend only)."
        },
    )
    rollout_max_model_len: int = field(
        default=4096, metadata={"help": "Context length (prompt + completion) of a vLLM server the trainer starts."}
    )
    rollout_server_timeout: float = field(
        default=600.0, metadata={"help": "Seconds to wait for the vLLM server to answer (start-up included)."}
    )
    tool_names: list[str] = field(
        default_factory=list,
        metadata={"help": "Tools the model may call, by name (trl_gptoss.tools.TOOLS): e.g. ['python']."},
    )
    rollout_geometric_rejection: bool = field(
        default=False,
        metadata={
            "help": "Reject whole sequences whose geometric-mean IS ratio leaves [rollout_rs_threshold_lower, "
            "rollout_rs_threshold] (verl's geo_rs); combines with the IS weights above."
        },
    )
    rollout_rs_threshold: float = field(
        default=1.001, metadata={"help": "Upper bound on the geometric-mean ratio for geometric rejection."}
    )
    rollout_rs_threshold_lower: float = field(
        default=0.999, metadata={"help": "Lower bound on the geometric-mean ratio for geometric rejection."}
    )
    routing_replay: str = field(
        default="off",
        metadata={
            "help": "MoE routing replay. 'rollout' (R3): the rollout engine reports the experts its routers chose "
            "for every token (rollout_backend='vllm_server') and the training passes route exactly so; positions "
            "without a route fall back to the router. 'old_logprob' (R2): the old-log-prob pass of an "
            "off-policy run records its experts and the loss pass replays them. 'off' (false): the router decides."
        },
    )
    routes_missing_max_fraction: float = field(
        default=0.5,
        metadata={
            "help": "With routing_replay='rollout': the largest share of a batch's positions (over every process) "
            "that may lack an engine route, which then routes as the trainer's router does. A batch above it fails "
            "the step, naming why routes were missing: a replay that has silently become plain routing. 1.0: "
            "never fail."
        },
    )
    max_staleness: int = field(
        default=0,
        metadata={
            "help": "0: strictly on-policy (generate, then train). 1: one step off-policy -- the next batch is "
            "generated on the rollout server while this step trains, with the weights one optimizer step older; "
            "rollout correction weighs the sampler's log-probs against the policy's. Needs rollout_backend="
            "'vllm_server'."
        },
    )
    eval_temperature: float | None = field(
        default=None,
        metadata={
            "help": "Sampling temperature of evaluation (eval_strategy / evaluate()): the held-out problems are "
            "sampled num_generations_eval times each at it; None: the training temperature."
        },
    )
    sp_size: int = field(
        default=1,
        metadata={
            "help": "Sequence-parallel (sink-aware Ulysses) group size; the loss pass runs through "
            "trl_gptoss.parallel. Must divide the number of processes and the attention heads."
        },
    )
    attn_implementation: str = field(
        default=FA3_SINK,
        metadata={"help": "Attention used for training log-probs; 'fa3_sink' honours GPT-OSS sinks exactly."},
    )
    experts_implementation: str = field(
        default="gptoss_sequential",
        metadata={"help": "MoE experts implementation; 'gptoss_sequential' is memory-safe in train and eval."},
    )
    logprobs_implementation: str = field(
        default="selective_logprobs",
        metadata={
            "help": "How the loss pass gets per-token log-probs: 'selective_logprobs' (gptoss_kernels, chunks of "
            "the vocabulary projection recomputed in backward, never [tokens, vocab] logits) or 'trl' (TRL's own "
            "fused head, kept for comparison)."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=UNSET_AUX_COEF,
        metadata={
            "help": "Load-balancing aux loss weight. Default 0.0 (GPT-OSS checkpoints declare 0.9, which "
            "TRL would add to the RL loss); a warning names the checkpoint's value."
        },
    )
    # -- long-context memory (trl_gptoss.long_context) ---------------------------------------------------------
    long_context_token_tile: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per tile for each decoder layer's RMSNorms, router and experts, run and recomputed tile "
            "by tile so their saved tensors exist for one tile at a time; null: the whole sequence at once."
        },
    )
    long_context_offload_checkpoints: bool = field(
        default=False,
        metadata={
            "help": "Keep the layers' gradient checkpoints in (pinned) host memory, brought back one layer ahead "
            "of the backward; needs gradient_checkpointing."
        },
    )
    # -- deprecated names (one release): mapped onto the fields above with a warning -------------------------
    max_turns: int | None = field(default=None, metadata={"help": "Deprecated: use max_tool_calling_iterations."})
    rollout_correction: str | None = field(
        default=None, metadata={"help": "Deprecated: use vllm_importance_sampling_* and rollout_geometric_rejection."}
    )
    rollout_is_threshold: float | None = field(
        default=None, metadata={"help": "Deprecated: use vllm_importance_sampling_clip_max."}
    )
    rollout_is_threshold_lower: float | None = field(
        default=None, metadata={"help": "Deprecated: use vllm_importance_sampling_clip_min."}
    )

    def __post_init__(self):
        self._map_deprecated()
        self._check_own_fields()
        self._check_parent_fields()
        self._check_optimisation_fields()
        if self.parallelism_config is not None and (
            self.parallelism_config.cp_enabled or self.parallelism_config.sp_enabled
        ):
            raise ValueError(
                "set sp_size for sequence parallelism; parallelism_config's cp/sp are not used by "
                "GptOssGRPOTrainer (it runs SP through trl_gptoss.parallel)"
            )
        super().__post_init__()
        _check_report_to(self.report_to)  # after TrainingArguments turned "all"/"none"/a name into a list
        if self.routing_replay == "old_logprob" and not self.needs_old_logprobs_pass:
            raise ValueError(
                "routing_replay='old_logprob' has nothing to replay: every batch is trained by one optimizer step "
                f"(gradient_accumulation_steps={self.gradient_accumulation_steps} is a multiple of "
                f"steps_per_generation={self.steps_per_generation} x num_iterations={self.num_iterations}), so no "
                "old-log-prob pass runs; use routing_replay='rollout' (the engine's routes), 'off', or reuse batches "
                "(e.g. num_iterations=2)"
            )
        self._check_staleness_schedule()
        self._check_model_init_implementations()
        if self.sp_size > 1 and self.world_size % self.sp_size:
            raise ValueError(f"sp_size={self.sp_size} must divide the number of processes ({self.world_size})")
        self._check_long_context()

    def _check_long_context(self) -> None:
        """The long-context options' own rules (``trl_gptoss.long_context.rules``), on the final field values."""
        from trl_gptoss.long_context.rules import check_long_context_fields

        check_long_context_fields(
            self.long_context_token_tile,
            self.long_context_offload_checkpoints,
            gradient_checkpointing=self.gradient_checkpointing,
            sp_size=self.sp_size,
            routing_replay=self.routing_replay,
            router_aux_loss_coef=self.router_aux_loss_coef,
        )

    def _check_model_init_implementations(self) -> None:
        """One owner for the implementations: ``model_init_kwargs`` naming another one than the field would load
        the policy with it while the reference model and sequence parallelism use the field."""
        init = self.model_init_kwargs if isinstance(self.model_init_kwargs, dict) else {}
        for name in ("attn_implementation", "experts_implementation"):
            if init.get(name) is not None and init[name] != getattr(self, name):
                raise ValueError(
                    f"model_init_kwargs.{name}={init[name]!r} differs from {name}={getattr(self, name)!r}: the "
                    f"policy would load with the first, the reference model and sequence parallelism use the "
                    f"second; set {name} only"
                )

    def _map_deprecated(self) -> None:
        for name, replacement in _DEPRECATED.items():
            if getattr(self, name) is not None:
                warnings.warn(f"{name} is deprecated; use {replacement}", DeprecationWarning, stacklevel=4)
        if self.max_turns is not None:
            check.positive_int("max_turns", self.max_turns)
            self.max_tool_calling_iterations = self.max_turns - 1
        if self.rollout_correction is not None:
            check.one_of("rollout_correction", self.rollout_correction, PRESETS)
            mode, geometric = trl_fields_of(self.rollout_correction)
            self.vllm_importance_sampling_correction = mode is not None
            self.vllm_importance_sampling_mode = mode or self.vllm_importance_sampling_mode
            self.rollout_geometric_rejection = geometric
        if self.rollout_is_threshold is not None:
            self.vllm_importance_sampling_clip_max = self.rollout_is_threshold
        if self.rollout_is_threshold_lower is not None:
            self.vllm_importance_sampling_clip_min = self.rollout_is_threshold_lower

    def _check_own_fields(self) -> None:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        import trl_gptoss  # noqa: F401  (registers fa3_sink and gptoss_sequential before the names are checked)

        check.one_of("rollout_backend", self.rollout_backend, tuple(ENGINE_KINDS))
        kind = ENGINE_KINDS[self.rollout_backend]
        if self.rollout_server_url is not None:
            from trl_gptoss.rollout.multi_server import server_urls

            if not kind.needs_server:
                raise ValueError(
                    f"rollout_server_url is set but rollout_backend={self.rollout_backend!r} samples in-process, "
                    "without a server; use rollout_backend='vllm_server' or drop the URL"
                )
            if not self.rollout_server_url:
                raise ValueError("rollout_server_url is an empty list; give at least one URL or null to start one")
            # one URL, "a,b" or a list; each entry checked (scheme, host, port, no path or credentials), no repeats
            self.rollout_server_url = server_urls(self.rollout_server_url)
        check.positive_int(
            "rollout_max_model_len", self.rollout_max_model_len, minimum=2, maximum=check.MAX_CONTEXT_TOKENS
        )
        check.finite_number("rollout_server_timeout", self.rollout_server_timeout, low=0, low_open=True)
        self.tool_names = _checked_tool_names(self.tool_names)
        self.correction_thresholds()  # validates the bounds
        if self.eval_temperature is not None:
            check.finite_number("eval_temperature", self.eval_temperature, low=0, low_open=True)
        check.positive_int("sp_size", self.sp_size)
        check.positive_int("max_staleness", self.max_staleness, minimum=0)
        if self.max_staleness > 1:
            raise ValueError(
                f"max_staleness={self.max_staleness} is not supported yet; use 0 (on-policy) or 1 (generation of "
                "the next batch overlaps this step's training)"
            )
        if self.max_staleness and not kind.may_overlap:
            raise ValueError(
                f"max_staleness=1 overlaps generation with training, but rollout_backend={self.rollout_backend!r} "
                "samples with the model being trained; set rollout_backend='vllm_server' or max_staleness=0"
            )
        check.registered("attn_implementation", self.attn_implementation, ALL_ATTENTION_FUNCTIONS)
        check.registered("experts_implementation", self.experts_implementation, ALL_EXPERTS_FUNCTIONS)
        check.one_of("logprobs_implementation", self.logprobs_implementation, LOGPROBS_IMPLEMENTATIONS)
        self.routing_replay = _routing_replay_mode(self.routing_replay)
        check.finite_number("routes_missing_max_fraction", self.routes_missing_max_fraction, low=0, high=1)
        if self.routing_replay == "rollout" and not kind.returns_routes:
            raise ValueError(
                f"routing_replay='rollout' replays the routes the rollout engine reports, but rollout_backend="
                f"{self.rollout_backend!r} reports none; use rollout_backend='vllm_server', or routing_replay="
                "'old_logprob' / 'off'"
            )

    def _check_parent_fields(self) -> None:
        """TRL fields whose bad values would fail late (after the model loads) or train silently wrong."""
        check.positive_int("max_completion_length", self.max_completion_length, maximum=check.MAX_CONTEXT_TOKENS)
        check.positive_int("num_generations", self.num_generations, minimum=2)
        check.positive_int("num_iterations", self.num_iterations)
        check.positive_int("steps_per_generation", self.steps_per_generation, allow_none=True)
        check.positive_int("generation_batch_size", self.generation_batch_size, allow_none=True)
        check.positive_int("max_tool_calling_iterations", self.max_tool_calling_iterations, minimum=0, allow_none=True)
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations >= MAX_TURNS:
            raise ValueError(
                f"max_tool_calling_iterations must be at most {MAX_TURNS - 1} (the rollout loop takes at most "
                f"{MAX_TURNS} turns per conversation), got {self.max_tool_calling_iterations}; null bounds the "
                "calls by max_completion_length instead"
            )
        check.finite_number("temperature", self.temperature, low=0, low_open=True)
        check.finite_number("top_p", self.top_p, low=0, high=1, low_open=True)
        check.positive_int("top_k", self.top_k, minimum=-1)
        if (self.engine_top_k > 0 or self.top_p < 1) and self.logprobs_implementation == "trl":
            raise ValueError(
                f"top_k={self.top_k} / top_p={self.top_p}: the engines sample from the truncated distribution, but "
                "logprobs_implementation='trl' scores the full softmax (the on-policy ratio against the engine "
                "would read the kept probability mass as mismatch); use logprobs_implementation='selective_logprobs'"
            )
        check.one_of("loss_type", self.loss_type, check.LOSS_TYPES)
        check.one_of("vllm_importance_sampling_mode", self.vllm_importance_sampling_mode, TRL_IS_MODES)
        if not isinstance(self.vllm_importance_sampling_correction, bool):
            raise ValueError(
                "vllm_importance_sampling_correction must be true or false, got "
                f"{self.vllm_importance_sampling_correction!r}"
            )
        if self.use_vllm:
            raise ValueError(
                "use_vllm=True selects TRL's own vLLM generation; GptOssGRPOTrainer generates "
                "through trl-gptoss engines: set rollout_backend='vllm_server' instead"
            )
        refused = refused_parent_fields(self)
        if refused:
            raise ValueError("GptOssGRPOTrainer cannot honour these TRL fields:\n  - " + "\n  - ".join(refused))

    def _check_optimisation_fields(self) -> None:
        """TRL's and transformers' numbers the run relies on. Unchecked, a NaN or an infinity trains into NaN
        weights (``learning_rate``, ``weight_decay``), silently turns the policy gradient (``epsilon``) or
        clipping (``max_grad_norm``) off, and a batch size, seed or step count out of range fails only after the
        model has loaded."""
        check.finite_number("learning_rate", self.learning_rate, low=0, low_open=True)
        check.finite_number("weight_decay", self.weight_decay, low=0)
        check.finite_number("adam_beta1", self.adam_beta1, low=0, high=1, high_open=True)
        check.finite_number("adam_beta2", self.adam_beta2, low=0, high=1, high_open=True)
        check.finite_number("adam_epsilon", self.adam_epsilon, low=0, low_open=True)
        # +inf clips nothing but still logs grad_norm; 0 or null turn clipping (and grad_norm) off
        check.finite_number("max_grad_norm", self.max_grad_norm, low=0, allow_inf=True, allow_none=True)
        check.finite_number("warmup_steps", self.warmup_steps, low=0)
        check.finite_number("num_train_epochs", self.num_train_epochs, low=0, low_open=True)
        check.finite_number("beta", self.beta, low=0)
        check.finite_number("epsilon", self.epsilon, low=0, low_open=True)
        check.finite_number("epsilon_high", self.epsilon_high, low=0, low_open=True, allow_none=True)
        check.finite_number("delta", self.delta, low=0, low_open=True, allow_none=True)
        check.finite_numbers("reward_weights", self.reward_weights, allow_none=True)
        check.positive_int("per_device_train_batch_size", self.per_device_train_batch_size)
        check.positive_int("per_device_eval_batch_size", self.per_device_eval_batch_size)
        check.positive_int("gradient_accumulation_steps", self.gradient_accumulation_steps)
        check.positive_int("max_steps", self.max_steps, minimum=-1)  # -1: num_train_epochs decides
        check.positive_int("seed", self.seed, minimum=0, maximum=2**32 - 1)  # numpy's seed range
        check.positive_int("data_seed", self.data_seed, minimum=0, maximum=2**32 - 1, allow_none=True)
        check.positive_int("save_total_limit", self.save_total_limit, minimum=0, allow_none=True)
        check.finite_number("logging_steps", self.logging_steps, low=0)
        check.finite_number("eval_steps", self.eval_steps, low=0, allow_none=True)  # 0/null: logging_steps
        saves_by_steps = self.save_strategy == "steps"  # a save every save_steps (a fraction < 1: of max_steps)
        check.finite_number("save_steps", self.save_steps, low=0, low_open=saves_by_steps)

    def _check_staleness_schedule(self) -> None:
        """The next generation is started at an optimizer-step boundary: it needs generations to begin there."""
        generate_every = self.steps_per_generation * self.num_iterations
        if self.max_staleness and generate_every % self.gradient_accumulation_steps:
            raise ValueError(
                f"max_staleness=1 starts the next generation between optimizer steps, but steps_per_generation="
                f"{self.steps_per_generation} x num_iterations={self.num_iterations} is not a multiple of "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} (generations would start inside "
                "an accumulation); make it a multiple or set max_staleness=0"
            )

    def correction_thresholds(self) -> CorrectionThresholds:
        return CorrectionThresholds(
            self.vllm_importance_sampling_clip_max,
            self.vllm_importance_sampling_clip_min,
            self.rollout_rs_threshold,
            self.rollout_rs_threshold_lower,
        )

    @property
    def correction_preset(self) -> CorrectionPreset:
        """What rollout correction does in this run, from TRL's IS fields and ``rollout_geometric_rejection``."""
        mode = self.vllm_importance_sampling_mode if self.vllm_importance_sampling_correction else None
        return preset_from_trl(mode, self.rollout_geometric_rejection)

    @property
    def engine_top_k(self) -> int:
        """``top_k`` as the engines and the heads take it: -1 when off (TRL's 0 and null)."""
        return self.top_k if self.top_k and self.top_k > 0 else -1

    @property
    def max_turns_per_conversation(self) -> int:
        """Assistant turns a conversation may take: one per answered tool call plus the final one."""
        if self.max_tool_calling_iterations is None:  # every turn samples at least one token
            return min(self.max_completion_length, MAX_TURNS)
        return self.max_tool_calling_iterations + 1

    @property
    def needs_old_logprobs_pass(self) -> bool:
        """TRL's rule: a batch is trained by more than one optimizer step (generations and iterations do not line
        up with optimizer steps), so the weights the batch's first step started from need their own pass.
        Otherwise the proximal log-probs ARE the loss pass's own, detached."""
        return self.gradient_accumulation_steps % (self.steps_per_generation * self.num_iterations) != 0

    @property
    def strictly_on_policy(self) -> bool:
        """Every completion is trained on only by the parameters that generated it: no batch reuse and no
        overlap (``max_staleness=0``), so the PPO ratio is exactly 1 and the engine samples the trained policy."""
        return not self.needs_old_logprobs_pass and self.max_staleness == 0


def _check_report_to(report_to: list[str]) -> None:
    """Every integration ``report_to`` names is one transformers knows and is installed here: the Trainer
    would fail on it only after the model loaded (or, for some, at the first log)."""
    from transformers.integrations import get_available_reporting_integrations
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    unknown = [name for name in report_to if name not in INTEGRATION_TO_CALLBACK]
    if unknown:
        raise ValueError(
            f"report_to names unknown integrations {check.shown(unknown)}; choose from "
            f"{sorted(INTEGRATION_TO_CALLBACK)} or none"
        )
    installed = set(get_available_reporting_integrations()) | {"kubeflow"}  # added by transformers only if found
    missing = [name for name in report_to if name not in installed and not _flyte_installed(name)]
    if missing:
        raise ValueError(
            f"report_to names {missing}, not installed here (installed: {sorted(installed - {'kubeflow'}) or 'none'}); "
            "install it or set report_to: none"
        )


def _flyte_installed(name: str) -> bool:
    from transformers.integrations.integration_utils import is_flyte_deck_standard_available

    return name == "flyte" and is_flyte_deck_standard_available()


ROUTING_REPLAY_MODES = ("off", "old_logprob", "rollout")


def _routing_replay_mode(value) -> str:
    """``routing_replay`` as one of ``ROUTING_REPLAY_MODES``; ``true`` keeps its old meaning (``old_logprob``)."""
    if isinstance(value, bool) or value in ("true", "false", "True", "False"):
        return "old_logprob" if value in (True, "true", "True") else "off"
    check.one_of("routing_replay", value, ROUTING_REPLAY_MODES)
    return value


def _checked_tool_names(names) -> list[str]:
    from trl_gptoss.tools import TOOLS

    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"tool_names must be a list of tool names such as ['python'], got {check.shown(names)}")
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"tool_names has unknown tools {check.shown(unknown)}; available: {sorted(TOOLS)}")
    return list(names)


def field_names() -> list[str]:
    """Every field of the config (TRL's and ours), for 'did you mean' hints."""
    return [f.name for f in fields(GptOssGRPOConfig)]
