"""GptOssGRPOConfig fields, YAML parsing and validation; bad datasets and reward functions fail clearly."""

import logging
import math

import pytest
from datasets import Dataset
from trl import TrlParser

from tests.trainer.helpers import grpo_args, prompt_dataset
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.trainer import GptOssGRPOConfig, GptOssGRPOTrainer
from trl_gptoss.trainer.config import UNSET_AUX_COEF


def test_defaults_and_every_added_field_has_help():
    args = GptOssGRPOConfig("out", use_cpu=True)
    assert (args.attn_implementation, args.experts_implementation) == ("fa3_sink", "gptoss_sequential")
    assert args.router_aux_loss_coef == 0.0 and args.strictly_on_policy
    added = set(GptOssGRPOConfig.__dataclass_fields__) - set(super(GptOssGRPOConfig, args).__dataclass_fields__)
    added.add("router_aux_loss_coef")
    for name in added:
        assert GptOssGRPOConfig.__dataclass_fields__[name].metadata.get("help"), name


def test_yaml_through_trlparser(tmp_path):
    config = tmp_path / "grpo.yaml"
    config.write_text(
        "output_dir: out\nuse_cpu: true\nrollout_backend: transformers\nmax_turns: 3\n"
        "tool_names: [python]\nrollout_correction: seq_mis\nrollout_is_threshold: 1.5\n"
        "router_aux_loss_coef: 0.0\nnum_iterations: 2\nrouting_replay: true\n"
    )
    (args,) = TrlParser((GptOssGRPOConfig,)).parse_args_and_config(["--config", str(config)])
    assert (args.rollout_backend, args.max_turns, args.tool_names) == ("transformers", 3, ["python"])
    assert args.rollout_correction == "seq_mis" and args.correction_thresholds().is_upper == 1.5
    assert args.router_aux_loss_coef is not UNSET_AUX_COEF and args.routing_replay


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(rollout_backend="sglang"), "rollout_backend"),
        (dict(rollout_backend="transformers", rollout_server_url="http://x:1"), "in-process"),
        (dict(rollout_server_url="localhost:8000"), "http://"),
        (dict(max_turns=0), "max_turns"),
        (dict(rollout_correction="tis"), "rollout_correction"),
        (dict(rollout_is_threshold=-1.0), "threshold"),
        (dict(rollout_rs_threshold=0.5), "threshold"),
        (dict(routing_replay=True), "strictly on-policy"),
        (dict(use_vllm=True), "rollout_backend"),
        (dict(sp_size=3), "sp_size"),
    ],
)
def test_inconsistent_configs_fail_at_construction(fields, match):
    with pytest.raises(ValueError, match=match):
        GptOssGRPOConfig("out", use_cpu=True, **fields)


def reward_ok(completions, **kwargs):
    return [0.0] * len(completions)


def reward_short(completions, **kwargs):
    return [0.0]


def reward_nan(completions, **kwargs):
    return [math.nan] * len(completions)


def test_dataset_row_missing_a_field_is_named(tokenizer, tmp_path):
    rows = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}, {"prompt": None, "answer": "2"}]
    )
    with pytest.raises(ValueError, match="row 1 is missing field 'prompt'"):
        GptOssGRPOTrainer(
            tiny_gpt_oss(),
            reward_ok,
            args=grpo_args(tmp_path),
            train_dataset=rows,
            processing_class=tokenizer,
            tools=[],
        )

    def needs_answer(completions, answer, **kwargs):
        return [0.0] * len(completions)

    rows = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
            {"prompt": [{"role": "user", "content": "yo"}], "answer": None},
        ]
    )
    with pytest.raises(ValueError, match="row 1 is missing field 'answer'"):
        GptOssGRPOTrainer(
            tiny_gpt_oss(),
            needs_answer,
            args=grpo_args(tmp_path),
            train_dataset=rows,
            processing_class=tokenizer,
            tools=[],
        )


@pytest.mark.parametrize(
    "reward, match",
    [(reward_short, "'reward_short' returned 1 rewards for 2"), (reward_nan, "'reward_nan' returned NaN")],
)
def test_bad_reward_outputs_name_the_function(tokenizer, tmp_path, reward, match):
    trainer = GptOssGRPOTrainer(
        tiny_gpt_oss(),
        reward,
        args=grpo_args(
            tmp_path, max_completion_length=8, max_steps=1, num_generations=2, per_device_train_batch_size=2
        ),
        train_dataset=prompt_dataset([0, 1]),
        processing_class=tokenizer,
        tools=[],
    )
    with pytest.raises(ValueError, match=match):
        trainer.train()


def test_server_that_does_not_answer_fails_at_construction(tokenizer, tmp_path):
    from trl_gptoss.testing.vllm_server import free_port

    args = grpo_args(tmp_path, rollout_backend="vllm_server", rollout_server_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match="does not answer"):
        GptOssGRPOTrainer(
            tiny_gpt_oss(),
            reward_ok,
            args=args,
            train_dataset=prompt_dataset([0]),
            processing_class=tokenizer,
            tools=[],
        )


def test_aux_coef_defaults_to_zero_with_a_warning_naming_the_checkpoint_value(tokenizer, tmp_path, caplog):
    model = tiny_gpt_oss(router_aux_loss_coef=0.9)
    with caplog.at_level(logging.WARNING):
        trainer = GptOssGRPOTrainer(
            model,
            reward_ok,
            args=grpo_args(tmp_path),
            train_dataset=prompt_dataset([0]),
            processing_class=tokenizer,
            tools=[],
        )
    assert trainer.router_aux_loss_coef == 0.0 and not trainer.aux_loss_enabled
    assert "router_aux_loss_coef=0.9" in caplog.text
    chosen = GptOssGRPOTrainer(
        tiny_gpt_oss(router_aux_loss_coef=0.9),
        reward_ok,
        args=grpo_args(tmp_path, router_aux_loss_coef=0.5),
        train_dataset=prompt_dataset([0]),
        processing_class=tokenizer,
        tools=[],
    )
    assert chosen.router_aux_loss_coef == 0.5


def test_model_card_tags_citations_and_curves(tokenizer, tmp_path):
    trainer = GptOssGRPOTrainer(
        tiny_gpt_oss(),
        reward_ok,
        args=grpo_args(tmp_path),
        train_dataset=prompt_dataset([0]),
        processing_class=tokenizer,
        tools=[],
    )
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "reward.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    for tag in ("trl", "grpo", "gpt-oss", "trl-gptoss"):
        assert f"- {tag}" in card
    assert "2402.03300" in card and "2504.11536" in card and "2309.17453" in card
    assert "![reward](plots/reward.png)" in card
