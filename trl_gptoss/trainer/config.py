"""``GptOssGRPOConfig``: TRL's ``GRPOConfig`` plus the rollout layer, rollout correction, R3 and SP settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from trl_gptoss.trainer.correction import PRESETS, CorrectionThresholds

ROLLOUT_BACKENDS = ("vllm_server", "transformers")


class _UnsetZero(float):
    """The default ``router_aux_loss_coef`` (0.0), distinguishable from a 0.0 the user chose, so the trainer
    warns only when it silently overrides the checkpoint's coefficient."""

    def __repr__(self):
        return "0.0"


UNSET_AUX_COEF = _UnsetZero(0.0)


@dataclass
class GptOssGRPOConfig(GRPOConfig):
    """GRPO for GPT-OSS on the trl-gptoss rollout layer (see docs/trainer.md for every field and metric).

    Generation never goes through TRL's ``use_vllm`` path: ``rollout_backend`` picks the trl-gptoss engine
    (a ``vllm serve`` server over HTTP, or in-process transformers) and the multi-turn Harmony tool loop.
    """

    rollout_backend: str = field(
        default="vllm_server",
        metadata={
            "help": f"Rollout engine, one of {ROLLOUT_BACKENDS}: 'vllm_server' samples from a `vllm serve` "
            "server (weights pushed after every optimizer step); 'transformers' samples in-process "
            "from the trained model itself."
        },
    )
    rollout_server_url: str | None = field(
        default=None,
        metadata={
            "help": "Base URL of a running vLLM server (e.g. http://127.0.0.1:8000). None starts one on "
            "this machine serving the model (vllm_server backend only)."
        },
    )
    rollout_max_model_len: int = field(
        default=4096, metadata={"help": "Context length (prompt + completion) of a vLLM server the trainer starts."}
    )
    rollout_server_timeout: float = field(
        default=600.0, metadata={"help": "Seconds to wait for the vLLM server to answer (start-up included)."}
    )
    max_turns: int = field(
        default=8, metadata={"help": "Most assistant turns per conversation (each tool call starts a new one)."}
    )
    tool_names: list[str] = field(
        default_factory=list,
        metadata={"help": "Tools the model may call, by name (from trl_gptoss.tools): e.g. ['python']."},
    )
    rollout_correction: str = field(
        default="token_tis",
        metadata={
            "help": f"Rollout-correction preset, one of {sorted(PRESETS)} (verl-equivalent; see "
            "trl_gptoss.trainer.correction). Mismatch metrics are logged whatever the preset."
        },
    )
    rollout_is_threshold: float = field(
        default=2.0, metadata={"help": "Upper bound on the IS ratio: truncation cap (tis) or mask bound (mis)."}
    )
    rollout_is_threshold_lower: float | None = field(
        default=None,
        metadata={"help": "Lower bound on the IS ratio. None: no lower clamp for *_tis, 1/upper for *_mis."},
    )
    rollout_rs_threshold: float = field(
        default=1.001, metadata={"help": "Upper bound on the geometric-mean ratio for geo_rs rejection."}
    )
    rollout_rs_threshold_lower: float = field(
        default=0.999, metadata={"help": "Lower bound on the geometric-mean ratio for geo_rs rejection."}
    )
    routing_replay: bool = field(
        default=False,
        metadata={
            "help": "R3: when old log-probs need their own pass (off-policy), record the experts it "
            "routes to and replay them in the training pass."
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
        default="fa3_sink",
        metadata={"help": "Attention used for training log-probs; 'fa3_sink' honours GPT-OSS sinks exactly."},
    )
    experts_implementation: str = field(
        default="gptoss_sequential",
        metadata={"help": "MoE experts implementation; 'gptoss_sequential' is memory-safe in train and eval."},
    )
    router_aux_loss_coef: float | None = field(
        default=UNSET_AUX_COEF,
        metadata={
            "help": "Load-balancing aux loss weight. Default 0.0 (GPT-OSS checkpoints declare 0.9, which "
            "TRL would add to the RL loss); a warning names the checkpoint's value."
        },
    )

    def __post_init__(self):
        self._check_rollout_fields()
        if self.parallelism_config is not None and (
            self.parallelism_config.cp_enabled or self.parallelism_config.sp_enabled
        ):
            raise ValueError(
                "set sp_size for sequence parallelism; parallelism_config's cp/sp are not used by "
                "GptOssGRPOTrainer (it runs SP through trl_gptoss.parallel)"
            )
        super().__post_init__()
        if self.use_vllm:
            raise ValueError(
                "use_vllm=True selects TRL's own vLLM generation; GptOssGRPOTrainer generates "
                "through trl-gptoss engines: set rollout_backend='vllm_server' instead"
            )
        if self.routing_replay and self.strictly_on_policy:
            raise ValueError(
                "routing_replay=True has nothing to replay: this run is strictly on-policy (gradient_accumulation_"
                f"steps={self.gradient_accumulation_steps} is a multiple of steps_per_generation="
                f"{self.steps_per_generation} x num_iterations={self.num_iterations}), so no old-log-prob pass "
                "runs; drop routing_replay or train off-policy (e.g. num_iterations=2)"
            )
        if self.sp_size > 1 and self.world_size % self.sp_size:
            raise ValueError(f"sp_size={self.sp_size} must divide the number of processes ({self.world_size})")

    def _check_rollout_fields(self):
        if self.rollout_backend not in ROLLOUT_BACKENDS:
            raise ValueError(f"rollout_backend={self.rollout_backend!r}; choose one of {ROLLOUT_BACKENDS}")
        if self.rollout_backend == "transformers" and self.rollout_server_url is not None:
            raise ValueError(
                "rollout_server_url is set but rollout_backend='transformers' generates in-process; "
                "use rollout_backend='vllm_server' or drop the URL"
            )
        if self.rollout_server_url is not None and not self.rollout_server_url.startswith(("http://", "https://")):
            raise ValueError(f"rollout_server_url must start with http:// or https://, got {self.rollout_server_url!r}")
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns must be a positive int, got {self.max_turns!r}")
        if self.rollout_correction not in PRESETS:
            raise ValueError(f"rollout_correction={self.rollout_correction!r}; choose one of {sorted(PRESETS)}")
        self.correction_thresholds()  # validates the bounds
        if not isinstance(self.sp_size, int) or self.sp_size < 1:
            raise ValueError(f"sp_size must be a positive int, got {self.sp_size!r}")
        if isinstance(self.tool_names, str):
            self.tool_names = [self.tool_names]

    def correction_thresholds(self) -> CorrectionThresholds:
        return CorrectionThresholds(
            self.rollout_is_threshold,
            self.rollout_is_threshold_lower,
            self.rollout_rs_threshold,
            self.rollout_rs_threshold_lower,
        )

    @property
    def strictly_on_policy(self) -> bool:
        """Every completion is trained on only by the parameters that generated it (TRL's own rule: generations
        and iterations line up with optimizer steps), so old log-probs ARE the current ones, detached."""
        return self.gradient_accumulation_steps % (self.steps_per_generation * self.num_iterations) == 0
