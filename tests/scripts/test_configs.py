"""Every example config parses into (JobArguments, GptOssGRPOConfig); bad configs fail before any model loads."""

from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from trl_gptoss.rollout.multi_server import server_urls
from trl_gptoss.rollout.server import free_port
from trl_gptoss.scripts.grpo import JobArguments, check_job, parse_job_args
from trl_gptoss.trainer import GptOssGRPOConfig

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
TRAINING_YAMLS = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("accelerate"))
ACCELERATE_YAMLS = sorted(CONFIGS.glob("accelerate*.yaml"))
KNOWN = {f.name for t in (JobArguments, GptOssGRPOConfig) for f in fields(t)}


def test_the_examples_are_all_there():
    names = {p.stem for p in TRAINING_YAMLS}
    assert {
        "retool_cpu_demo",
        "retool_gpt_oss_20b",
        "retool_gpt_oss_120b",
        "gsm8k_gpt_oss_20b",
        "verifyif_gpt_oss_20b",
        "retool_gpt_oss_20b_sp",
        "retool_gpt_oss_120b_sp",
        "retool_gpt_oss_20b_lora",
    } <= names
    assert {
        "accelerate_fsdp2",
        "accelerate_fsdp2_multinode",
        "accelerate_fsdp2_sp_multinode",
        "accelerate_context_parallel",
    } <= {p.stem for p in ACCELERATE_YAMLS}


@pytest.mark.parametrize("path", TRAINING_YAMLS, ids=lambda p: p.stem)
def test_training_yaml_parses_into_gptoss_grpo_config(path):
    raw = yaml.safe_load(path.read_text())
    assert set(raw) <= KNOWN, f"unknown fields {sorted(set(raw) - KNOWN)}"
    # GPU recipes ask for bf16, which TrainingArguments refuses on a CUDA-less host: parse them as they would
    # run on the CPU; every other field goes through the real parser and __post_init__ checks.
    dead, server = None, []
    if raw.get("rollout_server_url"):  # no server here (ROLLOUT_NODE does not even resolve): a dead local port
        assert server_urls(raw["rollout_server_url"].replace("ROLLOUT_NODE", "127.0.0.1"))
        dead = f"http://127.0.0.1:{free_port()}"
        server = ["--rollout_server_url", dead]
    cpu = ["--bf16", "false", "--use_cpu", "true"] if raw.get("bf16") else []
    if raw.get("sp_size", 1) > 1:  # one process here: the SP group size is checked against it, and refused
        with pytest.raises(SystemExit, match=f"sp_size={raw['sp_size']} must divide the number of processes"):
            parse_job_args(["--config", str(path), *cpu, *server], check=False)
        cpu += ["--sp_size", "1"]
    job, training = parse_job_args(["--config", str(path), *cpu, *server], check=False)
    assert isinstance(training, GptOssGRPOConfig)
    expected = []  # the machine-specific checks: the checkpoint directory, the servers' /health
    if not Path(job.model_name_or_path).is_dir() and job.model_name_or_path.startswith("/"):
        expected.append("is not a directory")
    if dead is not None:
        expected.append(f"rollout_server_url entry '{dead}' does not answer GET /health")
    if expected:
        with pytest.raises(SystemExit) as info:
            check_job(job, training)
        assert all(e in str(info.value) for e in expected), str(info.value)
    else:
        check_job(job, training)
    for name, value in raw.items():
        if name == "rollout_server_url" and dead is not None:
            continue
        if (name in ("bf16", "use_cpu", "sp_size") and cpu) or name == "report_to":  # "none" is normalised to []
            continue
        got = getattr(job, name) if hasattr(job, name) else getattr(training, name)
        got = getattr(got, "value", got)  # enums (lr_scheduler_type, save_strategy)
        if isinstance(got, list) and not isinstance(value, list):  # a one-element list field given as a scalar
            value = [value]
        assert got == value or str(got) == str(value) or [str(v) for v in got] == [str(v) for v in value], name
    assert training.strictly_on_policy, "the example recipes are meant to be strictly on-policy"
    if job.task in ("arithmetic", "retool"):
        assert training.tool_names == ["python"]


@pytest.mark.parametrize("path", ACCELERATE_YAMLS, ids=lambda p: p.stem)
def test_accelerate_yaml_is_fsdp2_over_gpt_oss_layers(path):
    raw = yaml.safe_load(path.read_text())
    assert raw["distributed_type"] == "FSDP" and raw["fsdp_config"]["fsdp_version"] == 2
    assert raw["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "GptOssDecoderLayer"
    assert raw["num_processes"] % raw["num_machines"] == 0


def _error(argv) -> str:
    with pytest.raises(SystemExit) as info:
        parse_job_args(argv)
    return str(info.value)


def test_missing_config_file_says_which_path():
    message = _error(["--config", "no/such/config.yaml"])
    assert "no/such/config.yaml" in message and "does not exist" in message


def test_unknown_field_suggests_the_close_one(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("output_dir: /tmp/x\nuse_cpu: true\nbf16: false\nlearning_rat: 1.0e-5\n")
    message = _error(["--config", str(bad)])
    assert "learning_rat" in message and "learning_rate" in message


def _demo_yaml(tmp_path, **changes) -> str:
    from trl_gptoss.demo.paths import embedded_default_config

    raw = yaml.safe_load(embedded_default_config().read_text())
    raw.update(changes, output_dir=str(tmp_path / "unused"))
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"task": "gsm8k"}, "warm-started on the arithmetic task"),
        ({"tool_names": []}, "tool_names: [python]"),
        ({"bf16": True}, "bf16: false"),
        ({"task": "sudoku"}, "task='sudoku'"),
        ({"num_generations": 1}, "num_generations"),
        ({"rollout_backend": "sglang"}, "rollout_backend"),
        ({"rollout_backend": "vllm_server", "rollout_server_url": "http://127.0.0.1:9"}, "does not answer GET /health"),
    ],
    ids=[
        "embedded-other-task",
        "retool-without-python",
        "embedded-bf16",
        "unknown-task",
        "one-generation",
        "unknown-backend",
        "server-not-answering",
    ],
)
def test_impossible_combinations_fail_with_what_to_change(tmp_path, changes, expected):
    assert expected in _error(["--config", _demo_yaml(tmp_path, **changes)])
