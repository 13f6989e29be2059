"""A corpus of broken configs: each one stops in ``parse_job_args`` (before any model loads) with a message that
names the key at fault. Every case is the CPU demo's YAML with one change."""

from pathlib import Path

import pytest
import yaml

from trl_gptoss.demo.paths import embedded_default_config
from trl_gptoss.scripts.grpo import parse_job_args

NOT_A_DIRECTORY = "NOT_A_DIRECTORY"  # replaced by a path under a regular file
INCOMPLETE_CHECKPOINT = "INCOMPLETE_CHECKPOINT"  # replaced by a checkpoint-N without trainer_state.json
CHECKPOINT = "CHECKPOINT"  # replaced by an (empty) checkpoint directory: the checks never load it

# (id, YAML changes, the key the message must name)
CORPUS = [
    # tools, sizes and sampling
    ("unknown-tool", {"tool_names": ["python", "calculator"]}, "tool_names"),
    ("tool-names-null", {"tool_names": None}, "tool_names"),
    ("num-prompts-0", {"num_prompts": 0}, "num_prompts"),
    ("num-generations-0", {"num_generations": 0}, "num_generations"),
    ("max-completion-length-0", {"max_completion_length": 0}, "max_completion_length"),
    ("temperature-negative", {"temperature": -1.0}, "temperature"),
    ("top-p-2", {"top_p": 2.0}, "top_p"),
    ("steps-per-generation-0", {"steps_per_generation": 0}, "steps_per_generation"),
    ("num-iterations-0", {"num_iterations": 0}, "num_iterations"),
    ("max-turns-true", {"max_turns": True}, "max_turns"),
    # implementations and losses
    ("unknown-attention", {"attn_implementation": "flash_attention_9"}, "attn_implementation"),
    ("unknown-experts", {"experts_implementation": "megablocks_v9"}, "experts_implementation"),
    ("unknown-loss", {"loss_type": "ppo_but_better"}, "loss_type"),
    (
        "malformed-server-url",
        {"rollout_backend": "vllm_server", "rollout_server_url": "localhost 8000"},
        "rollout_server_url",
    ),
    # paths
    ("unwritable-output-dir", {"output_dir": NOT_A_DIRECTORY}, "output_dir"),
    ("unwritable-proc-output-dir", {"output_dir": "/proc/trl-gptoss-no-such/run"}, "output_dir"),
    ("missing-resume-checkpoint", {"resume_from_checkpoint": "/no/such/checkpoint-7"}, "resume_from_checkpoint"),
    ("incomplete-resume-checkpoint", {"resume_from_checkpoint": INCOMPLETE_CHECKPOINT}, "resume_from_checkpoint"),
    ("resume-true", {"resume_from_checkpoint": True}, "resume_from_checkpoint"),
    ("unwritable-warmstart-dir", {"warmstart_dir": NOT_A_DIRECTORY}, "warmstart_dir"),
    # LoRA
    ("lora-r-0", {"lora_r": 0}, "lora_r"),
    ("lora-dropout-2", {"lora_dropout": 2.0}, "lora_dropout"),
    ("lora-alpha-0", {"lora_alpha": 0}, "lora_alpha"),
    ("lora-target-modules-empty", {"lora_target_modules": []}, "lora_target_modules"),
    # the job's other fields
    ("unknown-dtype", {"dtype": "float8"}, "dtype"),
    ("unknown-task", {"task": "sudoku"}, "task"),
    ("unknown-dataset-source", {"dataset_source": "ftp"}, "dataset_source"),
    ("dataset-limit-0", {"dataset_limit": 0}, "dataset_limit"),
    ("dataset-name-without-hub", {"dataset_name": "me/my-set"}, "dataset_name"),
    ("warmstart-steps-0", {"warmstart_steps": 0}, "warmstart_steps"),
    ("warmstart-tool-fraction-2", {"warmstart_tool_fraction": 2.0}, "warmstart_tool_fraction"),
    ("warmstart-learning-rate-0", {"warmstart_learning_rate": 0.0}, "warmstart_learning_rate"),
    ("num-prompts-text", {"num_prompts": "many"}, "num_prompts"),
    ("num-prompts-list", {"num_prompts": [8]}, "num_prompts"),
    ("unknown-scheduler", {"lr_scheduler_type": "cosine_but_faster"}, "lr_scheduler_type"),
    ("run-name-number", {"run_name": 2024}, "run_name"),
    ("misspelt-field", {"learning_rat": 1e-5}, "learning_rat"),
    # numbers that trained into NaN or failed after loading (#32)
    ("learning-rate-inf", {"learning_rate": float("inf")}, "learning_rate"),
    ("max-grad-norm-nan", {"max_grad_norm": float("nan")}, "max_grad_norm"),
    ("seed-negative", {"seed": -1}, "seed"),
    ("warmstart-learning-rate-inf", {"warmstart_learning_rate": float("inf")}, "warmstart_learning_rate"),
    ("reward-weights-two-for-one-reward", {"reward_weights": [1.0, 0.5]}, "reward_weights"),
    # routing replay (#33): an unknown mode; a mode the in-process engine cannot serve
    ("routing-replay-unknown", {"routing_replay": "sometimes"}, "routing_replay"),
    ("routing-replay-rollout-in-process", {"routing_replay": "rollout"}, "routing_replay"),
    # precision (a checkpoint path: the embedded model is fp32 and refuses every half type)
    ("fp16-over-bf16-weights", {"model_name_or_path": CHECKPOINT, "fp16": True, "task": "gsm8k"}, "fp16: true"),
]


def _write_config(tmp_path: Path, changes: dict) -> Path:
    raw = yaml.safe_load(embedded_default_config().read_text())
    raw.update(output_dir=str(tmp_path / "run"), rollout_backend="transformers")
    raw.update(changes)
    for key, value in raw.items():
        if value == NOT_A_DIRECTORY:
            (tmp_path / "a-file").write_text("")
            raw[key] = str(tmp_path / "a-file" / "run")
        elif value == CHECKPOINT:
            (tmp_path / "model").mkdir()
            raw[key] = str(tmp_path / "model")
        elif value == INCOMPLETE_CHECKPOINT:
            checkpoint = tmp_path / "run" / "checkpoint-3"
            checkpoint.mkdir(parents=True)
            (checkpoint / "model.safetensors").write_bytes(b"")
            raw[key] = str(checkpoint)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _error(argv) -> str:
    with pytest.raises(SystemExit) as info:
        parse_job_args(argv)
    message = str(info.value.code)
    assert message.startswith("error:"), message  # a message for the user, not a bare exit status
    return message


@pytest.mark.parametrize("changes, key", [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_broken_config_fails_naming_the_key(tmp_path, changes, key):
    message = _error(["--config", str(_write_config(tmp_path, changes))])
    assert key in message, message


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("output_dir: /tmp/x\ntool_names: [python\nmax_steps: 3\n")
    message = _error(["--config", str(path)])
    assert f"{path}:3:" in message and "not valid YAML" in message, message


@pytest.mark.parametrize(
    "text, expected", [("- a\n- b\n", "YAML mapping"), ("env: [A]\n", "env:")], ids=["list", "env"]
)
def test_config_that_is_not_a_mapping_says_so(tmp_path, text, expected):
    path = tmp_path / "shape.yaml"
    path.write_text(text)
    assert expected in _error(["--config", str(path)])


def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path):
    path = _write_config(tmp_path, {"learning_rate": 1e-6})
    first = path.read_text().splitlines().index("learning_rate: 1.0e-06") + 1
    path.write_text(path.read_text() + "learning_rate: 1.0e-5\n")
    last = len(path.read_text().splitlines())
    message = _error(["--config", str(path)])
    assert f"{path}:{last}:1:" in message and f"'learning_rate' is given twice (lines {first} and {last})" in message


def test_keys_merged_from_an_anchor_may_be_overridden(tmp_path):
    path = _write_config(tmp_path, {})
    path.write_text(path.read_text() + "model_init_kwargs:\n  <<: &kw {dtype: float32}\n  dtype: float32\n")
    assert parse_job_args(["--config", str(path)])[1].model_init_kwargs == {"dtype": "float32"}


def test_a_yaml_alias_bomb_gives_a_short_message_naming_the_key(tmp_path):
    value = "[lol]"
    for level in range(8):  # 9**8 = 43 million items from 8 short lines of aliases
        value = "[" + ", ".join([f"&a{level} {value}"] + [f"*a{level}"] * 8) + "]"
    path = _write_config(tmp_path, {"tool_names": "BOMB"})
    path.write_text(path.read_text().replace("tool_names: BOMB", f"tool_names: {value}"))
    message = _error(["--config", str(path)])
    assert "tool_names: expands to more than" in message and len(message) < 1000, message[:2000]


def test_a_long_value_is_echoed_cut(tmp_path):
    message = _error(["--config", str(_write_config(tmp_path, {"num_prompts": "x" * 10**6}))])
    assert "num_prompts" in message and len(message) < 1000, len(message)


def test_every_problem_is_reported_at_once(tmp_path):
    message = _error(["--config", str(_write_config(tmp_path, {"num_prompts": 0, "lora_r": 0, "dtype": "x"}))])
    assert all(key in message for key in ("num_prompts", "lora_r", "dtype")), message


def test_command_line_overrides_are_checked_too(tmp_path):
    config = str(_write_config(tmp_path, {}))
    assert "num_prompts" in _error(["--config", config, "--num_prompts", "0"])
    assert "lora_dropout" in _error(["--config", config, "--lora_dropout", "1.5"])


def test_latest_without_a_checkpoint_is_a_fresh_start_and_the_demo_config_passes(tmp_path):
    job, training = parse_job_args(["--config", str(_write_config(tmp_path, {"resume_from_checkpoint": "latest"}))])
    assert training.resume_from_checkpoint == "latest" and job.num_prompts == 512


@pytest.mark.parametrize("value, mode", [(False, "off"), ("off", "off"), (True, "old_logprob")])
def test_routing_replay_as_written_before_its_modes_had_names(tmp_path, value, mode):
    """A YAML's ``routing_replay: false`` (every shipped recipe had it) still parses; ``true`` keeps its meaning
    (the check that it has something to replay then applies, as before)."""
    changes = {"routing_replay": value}
    if value is True:
        changes["num_iterations"] = 2
    _, training = parse_job_args(["--config", str(_write_config(tmp_path, changes))])
    assert training.routing_replay == mode
