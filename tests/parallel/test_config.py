"""ContextParallelPlugin: defaults, environment variables and every refusal (all before any collective)."""

from __future__ import annotations

import pytest
import torch

from trl_gptoss.parallel import ContextParallelPlugin, HeadConfig, prepare_context_parallel
from trl_gptoss.testing import tiny_gpt_oss, tiny_gpt_oss_config


def test_defaults_disable_sp():
    plugin = ContextParallelPlugin()
    assert (plugin.sp_size, plugin.inner_attention, plugin.enabled) == (1, "eager", False)


def test_from_env_reads_prefixed_variables_and_keywords_win():
    env = {"TRL_GPTOSS_SP_SIZE": "4", "TRL_GPTOSS_SP_INNER_ATTENTION": "fa3_sink", "UNRELATED": "x"}
    plugin = ContextParallelPlugin.from_env(env)
    assert (plugin.sp_size, plugin.inner_attention, plugin.enabled) == (4, "fa3_sink", True)
    assert ContextParallelPlugin.from_env(env, sp_size=2).sp_size == 2


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"TRL_GPTOSS_SP_SIZE": "two"}, "TRL_GPTOSS_SP_SIZE='two' must be an integer"),
        ({"TRL_GPTOSS_SP_SIZE": "0"}, "sp_size must be a positive int"),
        ({"TRL_GPTOSS_SP_INNER_ATTENTION": "sdpa"}, "cannot take per-head sinks"),
    ],
    ids=["not-int", "zero", "sdpa"],
)
def test_from_env_rejects_bad_values(env, match):
    with pytest.raises(ValueError, match=match):
        ContextParallelPlugin.from_env(env)


@pytest.mark.parametrize("inner", ["sdpa", "flash_attention_2", "flex_attention", "paged|eager"])
def test_inner_attention_without_sinks_is_refused(inner):
    with pytest.raises(ValueError, match="cannot take per-head sinks"):
        ContextParallelPlugin(sp_size=2, inner_attention=inner)


@pytest.mark.parametrize("sp_size", [-1, 0, 1.5, True, "2"])
def test_sp_size_must_be_positive_int(sp_size):
    with pytest.raises(ValueError, match="sp_size must be a positive int"):
        ContextParallelPlugin(sp_size=sp_size)


def test_sp_size_must_divide_world():
    message = r"sp_size=4 must divide the number of processes \(6\).*\[1, 2, 3, 6\]"
    with pytest.raises(ValueError, match=message):
        ContextParallelPlugin(sp_size=4).check_world(6)
    ContextParallelPlugin(sp_size=3).check_world(6)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "sp_size", "match"),
    [
        (4, 2, 3, "must divide num_attention_heads=4"),
        (6, 2, 4, "must divide num_attention_heads=6"),
        (12, 3, 4, "num_key_value_heads=3 must divide one another"),
    ],
    ids=["hq", "hq-odd", "hkv"],
)
def test_heads_must_split_over_sp(heads, kv_heads, sp_size, match):
    config = tiny_gpt_oss_config(num_attention_heads=heads, num_key_value_heads=kv_heads)
    with pytest.raises(ValueError, match=match):
        ContextParallelPlugin(sp_size=sp_size).check_model(config)


@pytest.mark.parametrize("sp_size", [1, 2, 4, 8])
def test_heads_split_or_replicate(sp_size):
    ContextParallelPlugin(sp_size=sp_size).check_model(tiny_gpt_oss_config(num_attention_heads=8))


def test_prepare_refuses_sp_without_enough_processes():
    model = tiny_gpt_oss()
    with pytest.raises(ValueError, match=r"must divide the number of processes \(1\)"):
        prepare_context_parallel(None, model, ContextParallelPlugin(sp_size=2))
    assert model.config._attn_implementation == "eager"  # nothing was changed on failure


def test_prepare_refuses_gradient_checkpointing():
    model = tiny_gpt_oss()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="disable it"):
        prepare_context_parallel(None, model, ContextParallelPlugin(sp_size=1))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("temperature", 0.0, "temperature must be a positive finite number, got 0.0"),
        ("temperature", float("inf"), "temperature must be a positive finite number"),
        ("temperature", True, "temperature must be a positive finite number"),
        ("chunk_size", 0, "chunk_size must be a positive int or None, got 0"),
        ("chunk_size", 2.5, "chunk_size must be a positive int or None"),
        ("cast_to_fp32", 1, "cast_to_fp32 must be a bool, got 1"),
    ],
)
def test_head_config_names_the_bad_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        HeadConfig(**{field: value})


def test_entropy_grad_implies_entropies():
    assert HeadConfig(entropy_grad=True).entropy


def test_prepare_refuses_an_adapter_on_lm_head():
    """The sharded head reads lm_head.weight; a LoRA layer there would be skipped, so it is refused by name."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_gpt_oss(), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(
        ValueError, match=r"lm_head is a peft\.tuners\.lora\..*Linear; leave lm_head out of the adapter targets"
    ):
        prepare_context_parallel(None, model, ContextParallelPlugin(sp_size=1))


def test_prepare_accepts_lora_elsewhere_and_restores_forward():
    """LoRA on attention only: the runner's per-token values go through PEFT's wrapper; the bare model's
    forward is the class's again afterwards."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_gpt_oss(), LoraConfig(r=2, target_modules=["q_proj"])).train()
    runner = prepare_context_parallel(None, model, ContextParallelPlugin(sp_size=1))
    ids = torch.randint(0, 512, (2, 9))
    result = runner.forward_backward(ids, None, lambda logps: logps.sum())
    plain = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)
    torch.testing.assert_close(result.token_logps[:, 1:], plain.gather(-1, ids[:, 1:, None])[..., 0])
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    assert "forward" not in model.get_base_model().__dict__
    assert "forward" not in model.get_base_model().lm_head.__dict__
