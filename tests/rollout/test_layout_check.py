"""One layout check for every push target: the in-process engine refuses a mismatched push with the same
texts as a vLLM server (``check_layout``), before any weight changes; ``unwrap`` strips DDP and PEFT."""

import pytest
import torch

from trl_gptoss.rollout import TransformersEngine
from trl_gptoss.rollout.weights.names import check_layout, grouped_by_layer, unwrap
from trl_gptoss.testing import tiny_gpt_oss

SERVED = {"model.embed_tokens.weight": [64, 32], "model.layers.0.mlp.router.weight": [4, 32]}


@pytest.mark.parametrize(
    ("pushed", "message"),
    [
        pytest.param(
            {**SERVED, "model.layers.1.mlp.router.weight": [4, 32]},
            r"parameter 'model\.layers\.1\.mlp\.router\.weight' does not exist in the checkpoint http://h:1 serves",
            id="extra",
        ),
        pytest.param(
            {**SERVED, "model.layers.0.mlp.router.weight": [8, 32]},
            r"parameter 'model\.layers\.0\.mlp\.router\.weight' has shape \[8, 32\] but http://h:1 expects \[4, 32\]",
            id="shape",
        ),
        pytest.param(
            {"model.embed_tokens.weight": [64, 32]},
            r"http://h:1 serves 'model\.layers\.0\.mlp\.router\.weight' which the pushed model lacks \(1 missing\)",
            id="missing",
        ),
    ],
)
def test_check_layout_names_the_first_differing_parameter(pushed, message):
    check_layout(SERVED, SERVED, "http://h:1")
    with pytest.raises(ValueError, match=r"^weight push: " + message):
        check_layout(pushed, SERVED, "http://h:1")


@pytest.mark.parametrize(
    ("pushed_kwargs", "message"),
    [
        pytest.param(
            {"num_hidden_layers": 3},
            r"'model\.layers\.2\.[a-z_.]+' does not exist in the checkpoint the in-process engine serves",
            id="extra-layer",
        ),
        pytest.param(
            {"intermediate_size": 64},
            r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' has shape \[4, 128, 128\] but the in-process "
            r"engine expects \[4, 128, 256\]",
            id="shape",
        ),
        pytest.param(
            {"num_hidden_layers": 1},
            r"the in-process engine serves 'model\.layers\.1\.[a-z_.]+' which the pushed model lacks",
            id="missing-layer",
        ),
    ],
)
def test_in_process_engine_refuses_a_mismatched_push_like_a_server(pushed_kwargs, message):
    engine = TransformersEngine(tiny_gpt_oss(seed=0))
    before = {name: param.clone() for name, param in engine.model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        engine.push_weights(tiny_gpt_oss(seed=1, **pushed_kwargs))
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed by a refused push"


def test_unwrap_strips_module_wrappers_and_with_peft_the_peft_model():
    peft = pytest.importorskip("peft")
    model = tiny_gpt_oss(seed=0)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    holder = torch.nn.Module()
    holder.module = torch.nn.Module()
    holder.module.module = wrapped  # DDP-style .module nesting, twice
    assert unwrap(holder) is wrapped
    assert unwrap(holder, peft=True) is model
    assert unwrap(model, peft=True) is model


def test_grouped_by_layer_groups_consecutive_names_by_key():
    names = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b", "model.layers.1.a", "lm_head.w"]
    groups = [[n for n, _ in g] for g in grouped_by_layer((n, None) for n in names)]
    assert groups == [names[:1], names[1:3], names[3:4], names[4:]]
    assert [len(g) for g in grouped_by_layer(((n, None) for n in names), key=lambda n: n[:5])] == [4, 1]
