"""GptOssGRPOConfig fields, YAML parsing and validation; bad datasets and reward functions fail clearly."""

import dataclasses
import logging
import math
import re

import pytest
from datasets import Dataset
from trl import TrlParser

from tests.trainer.helpers import grpo_args, prompt_dataset
from trl_gptoss.rollout.config import MAX_TURNS
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.trainer import GptOssGRPOConfig, GptOssGRPOTrainer
from trl_gptoss.trainer.config import UNSET_AUX_COEF
from trl_gptoss.trainer.correction import CorrectionPreset
from trl_gptoss.trainer.rollouts import rollout_config


def test_defaults_and_every_added_field_has_help():
    args = GptOssGRPOConfig("out", use_cpu=True)
    assert (args.attn_implementation, args.experts_implementation) == ("fa3_sink", "gptoss_sequential")
    assert args.router_aux_loss_coef == 0.0 and args.strictly_on_policy
    ours = {f.name: f for f in dataclasses.fields(GptOssGRPOConfig)}  # fields, not ClassVars such as YAML_ALSO
    added = set(ours) - {f.name for f in dataclasses.fields(super(GptOssGRPOConfig, args))}
    added.add("router_aux_loss_coef")
    for name in added:
        assert ours[name].metadata.get("help"), name


def test_yaml_through_trlparser(tmp_path):
    config = tmp_path / "grpo.yaml"
    config.write_text(
        "output_dir: out\nuse_cpu: true\nrollout_backend: transformers\nmax_tool_calling_iterations: 2\n"
        "tool_names: [python]\nvllm_importance_sampling_mode: sequence_mask\n"
        "vllm_importance_sampling_clip_max: 1.5\nrouter_aux_loss_coef: 0.0\nnum_iterations: 2\n"
        "routing_replay: true\nrollout_server_url: null\n"
    )
    (args,) = TrlParser((GptOssGRPOConfig,)).parse_args_and_config(["--config", str(config)])
    assert (args.rollout_backend, args.max_turns_per_conversation, args.tool_names) == ("transformers", 3, ["python"])
    assert args.correction_preset == CorrectionPreset("sequence", "mask", False)
    assert args.correction_thresholds().is_upper == 1.5
    assert args.router_aux_loss_coef is not UNSET_AUX_COEF and args.routing_replay == "old_logprob"  # true's meaning


def test_trl_fields_are_the_vocabulary_with_our_defaults():
    args = GptOssGRPOConfig("out", use_cpu=True)
    assert args.correction_preset == CorrectionPreset("token", "truncate", False)  # TRL's default is sequence_mask
    assert args.correction_thresholds().is_upper == 2.0 and args.max_turns_per_conversation == 8
    off = GptOssGRPOConfig("out", use_cpu=True, vllm_importance_sampling_correction=False)
    assert not off.correction_preset.applies_weights
    unbounded = GptOssGRPOConfig("out", use_cpu=True, max_tool_calling_iterations=None, max_completion_length=64)
    assert unbounded.max_turns_per_conversation == 64
    # One turn bound, the rollout loop's: what the config accepts, the loop accepts (before, a long
    # max_completion_length with null iterations passed here and was refused at the first rollout).
    long = GptOssGRPOConfig("out", use_cpu=True, max_tool_calling_iterations=None, max_completion_length=16384)
    assert rollout_config(long, step=0, process_index=0).max_turns == MAX_TURNS
    most = GptOssGRPOConfig("out", use_cpu=True, max_tool_calling_iterations=MAX_TURNS - 1)
    assert rollout_config(most, step=0, process_index=0).max_turns == MAX_TURNS
    no_upper = GptOssGRPOConfig(
        "out", use_cpu=True, vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=None
    )
    assert no_upper.correction_thresholds().is_upper is None


@pytest.mark.parametrize(
    "old, new",
    [
        (dict(max_turns=3), dict(max_tool_calling_iterations=2)),
        (dict(rollout_correction="seq_mis"), dict(vllm_importance_sampling_mode="sequence_mask")),
        (dict(rollout_correction="none"), dict(vllm_importance_sampling_correction=False)),
        (
            dict(rollout_correction="geo_rs_token_tis"),
            dict(vllm_importance_sampling_mode="token_truncate", rollout_geometric_rejection=True),
        ),
        (dict(rollout_is_threshold=1.5), dict(vllm_importance_sampling_clip_max=1.5)),
        (dict(rollout_is_threshold_lower=0.2), dict(vllm_importance_sampling_clip_min=0.2)),
    ],
)
def test_deprecated_names_map_onto_the_trl_fields(old, new):
    with pytest.warns(DeprecationWarning, match="deprecated"):
        args = GptOssGRPOConfig("out", use_cpu=True, **old)
    for name, value in new.items():
        assert getattr(args, name) == value, name


@pytest.mark.parametrize(
    "fields, key",
    [
        (dict(min_p=0.1), "min_p"),
        (dict(repetition_penalty=1.2), "repetition_penalty"),
        (dict(generation_kwargs={"foo": 1}), "generation_kwargs"),
        (dict(vllm_server_base_url="http://x:1"), "vllm_server_base_url"),
        (dict(vllm_mode="server"), "vllm_mode"),
        (dict(use_transformers_paged=True), "use_transformers_paged"),
        (dict(chat_template_kwargs={"reasoning_effort": "low"}), "chat_template_kwargs"),
    ],
)
def test_trl_fields_we_cannot_honour_are_refused(fields, key):
    with pytest.raises(ValueError, match=f"(?s)cannot honour.*{key}"):
        GptOssGRPOConfig("out", use_cpu=True, **fields)


@pytest.mark.parametrize(
    "fields, key",
    [
        (dict(max_completion_length=0), "max_completion_length"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=0.0), "temperature"),
        (dict(top_p=2.0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(steps_per_generation=0), "steps_per_generation"),
        (dict(num_iterations=0), "num_iterations"),
        (dict(num_generations=0), "num_generations"),
        (dict(max_tool_calling_iterations=True), "max_tool_calling_iterations"),
        (dict(max_tool_calling_iterations=-1), "max_tool_calling_iterations"),
        (dict(max_tool_calling_iterations=1000), "max_tool_calling_iterations"),
        (dict(max_turns=1001), "max_tool_calling_iterations"),  # the deprecated name maps onto it
        (dict(max_turns=True), "max_turns"),
        (dict(tool_names=None), "tool_names"),
        (dict(tool_names=["calculator"]), "tool_names"),
        (dict(attn_implementation="flash_sink"), "attn_implementation"),
        (dict(experts_implementation="fast"), "experts_implementation"),
        (dict(loss_type="ppo"), "loss_type"),
        (dict(rollout_server_url="http://"), "rollout_server_url"),
        (dict(rollout_server_url="http://host:99999"), "rollout_server_url"),
        (dict(rollout_server_url=[]), "rollout_server_url"),
        (dict(vllm_importance_sampling_mode="tis"), "vllm_importance_sampling_mode"),
        (dict(vllm_importance_sampling_correction="yes"), "vllm_importance_sampling_correction"),
        (dict(vllm_importance_sampling_clip_max=0.0), "vllm_importance_sampling_clip_max"),
        (dict(rollout_rs_threshold=0.5), "rollout_rs_threshold"),
        (dict(model_init_kwargs={"attn_implementation": "eager"}), "model_init_kwargs.attn_implementation"),
        (dict(model_init_kwargs={"experts_implementation": "eager"}), "model_init_kwargs.experts_implementation"),
    ],
)
def test_bad_values_fail_at_construction_naming_the_key(fields, key):
    with pytest.raises(ValueError, match=key):
        GptOssGRPOConfig("out", use_cpu=True, **fields)


# TRL's and transformers' numbers the run relies on: each value was accepted and trained into NaN, silently turned
# a term off, or failed only after the model loaded (#32).
INHERITED_NUMBERS = [
    ("learning-rate-inf", dict(learning_rate=math.inf), "learning_rate"),  # NaN weights after one step
    ("learning-rate-nan", dict(learning_rate=math.nan), "learning_rate"),
    ("learning-rate-negative", dict(learning_rate=-1e-5), "learning_rate"),
    ("weight-decay-nan", dict(weight_decay=math.nan), "weight_decay"),  # 18 of 37 tensors NaN
    ("weight-decay-negative", dict(weight_decay=-0.1), "weight_decay"),
    ("epsilon-nan", dict(epsilon=math.nan), "epsilon"),  # loss 0: no policy gradient
    ("epsilon-0", dict(epsilon=0.0), "epsilon"),
    ("epsilon-high-nan", dict(epsilon_high=math.nan), "epsilon_high"),
    ("beta-nan", dict(beta=math.nan), "beta"),
    ("max-grad-norm-nan", dict(max_grad_norm=math.nan), "max_grad_norm"),  # clipping silently off
    ("max-grad-norm-negative", dict(max_grad_norm=-1.0), "max_grad_norm"),
    ("adam-beta1-1.5", dict(adam_beta1=1.5), "adam_beta1"),
    ("adam-beta2-1", dict(adam_beta2=1.0), "adam_beta2"),
    ("adam-epsilon-0", dict(adam_epsilon=0.0), "adam_epsilon"),
    ("batch-size-0", dict(per_device_train_batch_size=0), "per_device_train_batch_size"),
    ("eval-batch-size-0", dict(per_device_eval_batch_size=0), "per_device_eval_batch_size"),
    ("gradient-accumulation-0", dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    ("save-steps-negative", dict(save_steps=-1), "save_steps"),
    ("save-steps-0", dict(save_steps=0), "save_steps"),
    ("save-total-limit-negative", dict(save_total_limit=-1), "save_total_limit"),
    ("logging-steps-negative", dict(logging_steps=-1), "logging_steps"),
    ("warmup-steps-nan", dict(warmup_steps=math.nan), "warmup_steps"),
    ("num-train-epochs-nan", dict(num_train_epochs=math.nan), "num_train_epochs"),
    ("max-steps-negative", dict(max_steps=-5), "max_steps"),
    ("seed-negative", dict(seed=-1), "seed"),
    ("seed-beyond-numpy", dict(seed=2**32), "seed"),
    ("reward-weights-nan", dict(reward_weights=[math.nan]), "reward_weights"),
    ("reward-weights-text", dict(reward_weights=["1"]), "reward_weights"),
    ("report-to-unknown", dict(report_to=["wandb_but_better"]), "report_to"),
    ("max-completion-length-1e12", dict(max_completion_length=10**12), "max_completion_length"),
    ("rollout-max-model-len-1e12", dict(rollout_max_model_len=10**12), "rollout_max_model_len"),
]


@pytest.mark.parametrize("fields, key", [c[1:] for c in INHERITED_NUMBERS], ids=[c[0] for c in INHERITED_NUMBERS])
def test_inherited_numbers_out_of_range_fail_at_construction_naming_the_key(fields, key):
    with pytest.raises(ValueError, match=rf"\b{key}\b"):
        GptOssGRPOConfig("out", use_cpu=True, **fields)


def test_report_to_an_integration_that_is_not_installed_is_refused():
    from transformers.integrations import get_available_reporting_integrations
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    installed = set(get_available_reporting_integrations()) | {"kubeflow", "flyte"}
    absent = sorted(set(INTEGRATION_TO_CALLBACK) - installed)
    if not absent:
        pytest.skip("every reporting integration transformers knows is installed here")
    with pytest.raises(ValueError, match=f"report_to names \\['{absent[0]}'\\], not installed here"):
        GptOssGRPOConfig("out", use_cpu=True, report_to=[absent[0]])


def test_inherited_numbers_at_their_edges_are_accepted():
    edges = GptOssGRPOConfig(
        "out",
        use_cpu=True,
        max_grad_norm=math.inf,  # no clipping, grad_norm still logged
        weight_decay=0.0,
        adam_beta1=0.0,
        save_total_limit=0,
        save_strategy="no",
        save_steps=0,
        seed=2**32 - 1,
        reward_weights=[0.5],
        max_completion_length=131_072,
        report_to="none",
    )
    assert edges.max_grad_norm == math.inf and edges.report_to == []


def test_echoed_values_are_cut_to_a_line():
    with pytest.raises(ValueError) as info:
        GptOssGRPOConfig("out", use_cpu=True, tool_names=[["x" * 10**6] * 10**3])
    assert "tool_names" in str(info.value) and len(str(info.value)) < 500, len(str(info.value))


def test_server_url_list_is_kept_and_a_string_becomes_one():
    one = GptOssGRPOConfig("out", use_cpu=True, rollout_server_url="http://127.0.0.1:8000")
    two = GptOssGRPOConfig("out", use_cpu=True, rollout_server_url=["HTTP://localhost:1", "https://LocalHost:2/"])
    assert one.rollout_server_url == ["http://127.0.0.1:8000"]
    assert two.rollout_server_url == ["http://127.0.0.1:1", "https://localhost:2"]  # normalised once (server_urls)
    comma = GptOssGRPOConfig("out", use_cpu=True, rollout_server_url="http://127.0.0.1:1, http://127.1:2")
    assert comma.rollout_server_url == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    with pytest.raises(ValueError, match="rollout_server_url lists 'http://127.0.0.1:1' more than once"):
        GptOssGRPOConfig("out", use_cpu=True, rollout_server_url=["http://127.0.0.1:1", "http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="rollout_server_url lists one server more than once"):
        GptOssGRPOConfig("out", use_cpu=True, rollout_server_url=["http://localhost:1", "http://127.0.0.1:1/"])
    for refused in ("http://user:pw@127.0.0.1:1", "http://127.0.0.1:1/v1", "http://127.0.0.1:1?x=1"):
        with pytest.raises(ValueError, match=f"rollout_server_url entry '{re.escape(refused)}'"):
            GptOssGRPOConfig("out", use_cpu=True, rollout_server_url=refused)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(rollout_backend="sglang"), "rollout_backend"),
        (dict(rollout_backend="transformers", rollout_server_url="http://x:1"), "in-process"),
        (dict(rollout_server_url="localhost:8000"), "http://"),
        (dict(max_turns=0), "max_turns"),
        (dict(rollout_correction="tis"), "rollout_correction"),
        (dict(rollout_is_threshold=-1.0), "clip_max"),
        (dict(rollout_rs_threshold=0.5), "threshold"),
        (dict(routing_replay=True), "nothing to replay"),
        (dict(routing_replay="old_logprob"), "routing_replay='rollout'"),
        (dict(routing_replay="sometimes"), "routing_replay='sometimes'; choose one of"),
        (dict(routing_replay="rollout", rollout_backend="transformers"), "reports none"),
        (dict(top_p=0.9, logprobs_implementation="trl"), "scores the full softmax"),
        (dict(top_k=20, logprobs_implementation="trl"), "scores the full softmax"),
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


def test_reward_weights_of_the_wrong_count_are_refused_before_the_model_loads(tokenizer, tmp_path):
    """TRL counts them only after loading the model (minutes for gpt-oss-120b); here the model path does not even
    exist, so any other order would fail on the load instead."""
    with pytest.raises(
        ValueError, match=r"reward_weights has 1 weights, but there are 2 reward functions \(reward_ok, reward_nan\)"
    ):
        GptOssGRPOTrainer(
            str(tmp_path / "never-loaded"),
            [reward_ok, reward_nan],
            args=grpo_args(tmp_path, reward_weights=[1.0]),
            train_dataset=prompt_dataset([0]),
            processing_class=tokenizer,
            tools=[],
        )


@pytest.mark.parametrize(
    "reward, match",
    [
        (reward_short, "'reward_short' returned 1 rewards for 2"),
        (reward_nan, "'reward_nan' returned nan for completion 0"),
    ],
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


def test_model_card_names_the_run_and_its_base_and_has_a_working_quick_start(tokenizer, tmp_path):
    from trl_gptoss.testing import save_tiny_checkpoint

    base = save_tiny_checkpoint(tmp_path / "base", model=tiny_gpt_oss(), tokenizer=tokenizer)
    out = tmp_path / "my-run"
    trainer = GptOssGRPOTrainer(
        str(base),
        reward_ok,
        args=grpo_args(out),
        train_dataset=prompt_dataset([0]),
        processing_class=tokenizer,
        tools=[],
    )
    trainer.save_model(str(out))
    trainer.create_model_card()
    card = (out / "README.md").read_text()
    assert "None" not in card.split("## Training procedure")[0], card
    assert "# Model Card for my-run" in card and f"local checkpoint `{base}`" in card
    quick_start = card.split("```python\n")[1].split("```")[0]
    printed = []
    namespace = {"print": printed.append}
    exec(quick_start.replace('"my-run"', repr(str(out))).replace("max_new_tokens=128", "max_new_tokens=4"), namespace)
    assert len(printed) == 1 and isinstance(printed[0], str)


@pytest.mark.parametrize(
    "value, match",
    [
        (math.inf, "returned inf for completion 1"),
        (float("-inf"), "returned -inf for completion 1"),
        (1e308, "returned 1e\\+308 for completion 1"),
        ("1.0", "returned str '1.0' for completion 1"),
        ({"score": 1.0}, "returned dict .* for completion 1"),
        (object(), "returned object for completion 1, which is not a number"),
    ],
)
def test_reward_values_must_be_finite_numbers(value, match):
    from trl_gptoss.trainer.checks import checked_reward

    def picky(completions, **kwargs):
        return [0.5, value]

    with pytest.raises(ValueError, match=f"'picky' {match}"):
        checked_reward(picky)(completions=["a", "b"])


def test_reward_values_are_coerced_to_floats():
    import numpy as np
    import torch

    from trl_gptoss.trainer.checks import checked_reward

    def typed(completions, **kwargs):
        return [np.float32(0.5), torch.tensor(2.0), True, None]

    assert checked_reward(typed)(completions=list("abcd")) == [0.5, 2.0, 1.0, None]
    for nan in (np.float64("nan"), torch.tensor(float("nan"))):

        def nan_reward(completions, nan=nan, **kwargs):
            return [nan]

        with pytest.raises(ValueError, match="'nan_reward' returned nan"):
            checked_reward(nan_reward)(completions=["a"])


def _trainer_on(tokenizer, tmp_path, dataset, reward=reward_ok, **kwargs):
    return GptOssGRPOTrainer(
        tiny_gpt_oss(),
        reward,
        args=grpo_args(tmp_path, **kwargs),
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[],
    )


def test_dataset_without_rows_is_refused(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="train_dataset has no rows"):
        _trainer_on(tokenizer, tmp_path, prompt_dataset([0]).select([]))


def test_without_reward_funcs_trl_names_the_missing_reward_source(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="No reward source"):
        _trainer_on(tokenizer, tmp_path, prompt_dataset([0]), reward=None)


def test_iterable_dataset_trains(tokenizer, tmp_path):
    streamed = prompt_dataset([0, 1] * 4).to_iterable_dataset()
    trainer = _trainer_on(tokenizer, tmp_path, streamed, max_steps=1, max_completion_length=8)
    trainer.train()
    assert trainer.state.global_step == 1


def test_plain_text_prompts_are_one_user_message(tokenizer, tmp_path):
    seen = []

    def text_reward(prompts, completions, **kwargs):
        seen.extend(zip(prompts, completions))
        return [0.0] * len(completions)

    rows = Dataset.from_list([{"prompt": "Say four."}, {"prompt": "Add two and two."}])
    trainer = _trainer_on(tokenizer, tmp_path, rows, reward=text_reward, max_steps=1, max_completion_length=8)
    trainer.train()
    assert seen and all(isinstance(p, str) and isinstance(c, str) for p, c in seen)  # TRL's standard format
    first = trainer.sampler.last.rollouts[0]
    user_turn = tokenizer.decode(first.prompt_ids)
    assert "<|start|>user<|message|>Say four.<|end|>" in user_turn or "Add two and two." in user_turn


def test_reward_model_by_id_keeps_its_own_attention(tokenizer, tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    path = tmp_path / "reward-model"
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    trainer = _trainer_on(tokenizer, tmp_path, prompt_dataset([0]), reward=str(path))
    reward_model = trainer.reward_funcs[0]
    assert reward_model.config._attn_implementation != "fa3_sink"
    assert trainer.model.config._attn_implementation == "fa3_sink"


def test_a_launcher_world_accelerate_does_not_see_is_refused():
    from trl_gptoss.trainer.checks import check_world

    # what the multi-node YAML's launch line gives on a CPU host without --cpu (tests/trainer/test_multinode_launch.py)
    with pytest.raises(ValueError, match=r"started 2 processes \(WORLD_SIZE=2\) but accelerate sees 1.*use_cpu"):
        check_world(1, {"WORLD_SIZE": "2"})
    check_world(2, {"WORLD_SIZE": "2"})
    check_world(1, {})
    check_world(1, {"WORLD_SIZE": "1"})


@pytest.mark.parametrize("value, mode", [(False, "off"), ("false", "off"), ("rollout", "rollout"), ("off", "off")])
def test_routing_replay_modes(value, mode):
    assert GptOssGRPOConfig("out", use_cpu=True, routing_replay=value).routing_replay == mode
