"""Script arguments of the GRPO job: ``JobArguments`` (what it trains on and from) and ``EMBEDDED_MODEL``.

Every ``GptOssGRPOConfig`` field is accepted alongside these; ``grpo_parser.parse_job_args`` reads both from a
YAML plus ``--field value`` overrides, and ``grpo_checks.check_job`` checks them before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_gptoss.data.tasks import TASKS

EMBEDDED_MODEL = "embedded"


@dataclass
class JobArguments:
    """What the job trains on and from; every ``GptOssGRPOConfig`` field is accepted alongside these."""

    model_name_or_path: str = field(
        default=EMBEDDED_MODEL,
        metadata={
            "help": "Hub id or local checkpoint (e.g. openai/gpt-oss-20b), or 'embedded': build a tiny "
            "GPT-OSS with the real o200k vocabulary offline and warm-start it on Harmony "
            "tool-use demonstrations (the CPU demo)."
        },
    )
    dtype: str = field(
        default="bfloat16",
        metadata={
            "help": "Dtype the checkpoint is loaded in: bfloat16, float32 or auto (ignored for 'embedded', "
            "which trains in float32)."
        },
    )
    task: str = field(
        default="arithmetic",
        metadata={
            "help": f"A trl_gptoss.data.TASKS name, one of {sorted(TASKS)}: 'arithmetic' is the generated "
            "ReTool-style task of the CPU demo; the others read shipped samples or the Hub."
        },
    )
    dataset_source: str = field(
        default="sample", metadata={"help": "For retool/gsm8k/verifyif: 'sample' (shipped, offline) or 'hub'."}
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset id overriding the task's default (dataset_source='hub')."}
    )
    dataset_limit: int | None = field(default=None, metadata={"help": "Keep the first N rows of the dataset."})
    num_prompts: int = field(default=512, metadata={"help": "Prompts generated for task='arithmetic'."})
    warmstart_steps: int = field(
        default=300, metadata={"help": "'embedded' only: supervised steps (8 demonstrations each)."}
    )
    warmstart_demonstrations: int = field(
        default=2048, metadata={"help": "'embedded' only: number of generated Harmony demonstrations."}
    )
    warmstart_tool_fraction: float = field(
        default=0.5,
        metadata={
            "help": "'embedded' only: share of demonstrations that call the python tool (the rest answer "
            "with a wrong guess), so the warm-started policy uses the tool only sometimes."
        },
    )
    warmstart_dir: str | None = field(
        default=None,
        metadata={
            "help": "'embedded' only: where the warm-started checkpoint is saved/reused (default "
            "OUTPUT_DIR/warmstart); runs that share it start from the same policy."
        },
    )
    warmstart_seed: int | None = field(
        default=None,
        metadata={
            "help": "'embedded' only: seed of the model init and the demonstrations (default: --seed). Fix it "
            "to compare GRPO seeds from one warm-started policy."
        },
    )
    warmstart_learning_rate: float = field(default=3e-3, metadata={"help": "'embedded' only: SFT learning rate."})
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata={"help": "Module names LoRA adapts (attention by default; see docs/scaling.md for experts)."},
    )
    eval_problems: int = field(
        default=0,
        metadata={
            "help": "Held-out problems of the task evaluated at eval_strategy / eval_steps / eval_on_start "
            "(num_generations_eval samples each: mean@k, pass@k, maj@k); 0: no evaluation. Generated tasks draw "
            "them from a seed of their own, gsm8k from the Hub's test split with dataset_source=hub, the others "
            "set them aside from the training rows."
        },
    )
    plot: bool = field(default=True, metadata={"help": "Write training-curve PNGs to OUTPUT_DIR/plots at the end."})
