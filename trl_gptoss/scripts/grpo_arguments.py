"""Script arguments of the GRPO job (``JobArguments``) and their parsing.

``parse_job_args(argv)`` = ``TrlParser((JobArguments, GptOssGRPOConfig))`` on ``--config x.yaml`` plus
``--field value`` overrides, then ``check_job`` (``grpo_checks``): every error is a ``SystemExit`` that names
the key and what to change, raised before any model loads.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields

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
    plot: bool = field(default=True, metadata={"help": "Write training-curve PNGs to OUTPUT_DIR/plots at the end."})


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    if "--config" not in argv:
        return None, argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise SystemExit("error: --config needs a path to a YAML file (e.g. examples/configs/retool_cpu_demo.yaml)")
    return argv[i + 1], argv


def _known_fields(dataclass_types) -> list[str]:
    return [f.name for t in dataclass_types for f in fields(t)]


def _unknown_field_message(error: str, known: list[str]) -> str:
    """Add 'did you mean' hints to TRL's/argparse's unknown-argument errors."""
    hints = []
    for token in error.replace("[", " ").replace("]", " ").replace(",", " ").replace("'", " ").split():
        if token.startswith("--"):
            close = difflib.get_close_matches(token[2:], known, n=3)
            if close:
                hints.append(f"{token[2:]!r} -> did you mean {', '.join(close)}?")
    hint = ("\n  " + "\n  ".join(hints)) if hints else ""
    return (
        f"{error}{hint}\nFix the field name in the YAML/command line (fields: JobArguments in "
        "trl_gptoss/scripts/grpo_arguments.py and GptOssGRPOConfig; `--help` lists them)."
    )


def read_config(path: str) -> dict:
    """The YAML mapping at ``path``; ``SystemExit`` naming the file, the line and what is wrong."""
    import yaml

    if not os.path.isfile(path):
        raise SystemExit(
            f"error: config file {path!r} does not exist; give a YAML path such as "
            "examples/configs/retool_cpu_demo.yaml (relative to the directory you run from)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        problem = getattr(exc, "problem", None) or exc
        raise SystemExit(f"error: {where}: not valid YAML ({problem}); fix the syntax at that line") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"error: config file {path!r} cannot be read ({exc})") from None
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise SystemExit(
            f"error: {path}: the config must be a YAML mapping of `field: value` lines, got a {type(config).__name__}"
        )
    if not isinstance(config.get("env", {}), dict):
        raise SystemExit(f"error: {path}: env: give a mapping of environment variables (`env: {{NAME: value}}`)")
    return config


def parse_job_args(argv: list[str] | None, *, check: bool = True):
    """``(JobArguments, GptOssGRPOConfig)`` from ``--config x.yaml`` and ``--field value`` overrides.

    Every error is a ``SystemExit`` naming the key: invalid YAML, a value of the wrong type, an unknown field
    (with the closest known names), a value ``GptOssGRPOConfig`` refuses, and -- unless ``check=False`` --
    what ``check_job`` refuses (job fields, combinations, paths and the vLLM install on this machine).
    """
    import sys

    from trl import TrlParser

    from trl_gptoss.scripts.config_values import field_types, value_problems
    from trl_gptoss.trainer import GptOssGRPOConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, argv = _split_config(argv)
    types = (JobArguments, GptOssGRPOConfig)
    if config_path is not None:
        config = read_config(config_path)
        config.pop("env", None)
        if problems := value_problems(config, field_types(types)):
            raise SystemExit(f"error: {config_path}: wrong value types:\n  - " + "\n  - ".join(problems))
    parser = TrlParser(types)
    try:
        job, training = parser.parse_args_and_config(argv)
    except ValueError as exc:
        if "Unknown arguments" in str(exc):
            raise SystemExit("error: " + _unknown_field_message(str(exc), _known_fields(types))) from None
        raise SystemExit(f"error: invalid training configuration: {exc}") from None
    except (TypeError, AttributeError, KeyError) as exc:  # a __post_init__ tripping over a value
        raise SystemExit(f"error: invalid training configuration ({type(exc).__name__}: {exc})") from None
    if check:
        from trl_gptoss.scripts.grpo_checks import check_job

        check_job(job, training)
    return job, training
