"""Whole tiny GPT-OSS: patched == unpatched (logits, every gradient, greedy generate); the handle reverts;
the ExpertsInterface registration dispatches to the sequential path."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from tests.kernels.experts.helpers import max_rel_diff
from trl_gptoss.experts import SEQUENTIAL_EXPERTS, GptOssSequentialExperts, patch_gpt_oss_experts
from trl_gptoss.testing import tiny_gpt_oss


def _inputs(batch=2, length=40, seed=0):
    return torch.randint(0, 512, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference_model():
    model = tiny_gpt_oss(seed=3)
    model.set_experts_implementation("eager")
    return model


def test_patched_model_matches_unpatched_logits_and_grads(reference_model):
    input_ids = _inputs()
    reference_model.train()
    expected_logits, expected_grads = _logits_and_grads(reference_model, input_ids)
    with patch_gpt_oss_experts(reference_model) as handle:
        assert handle.module_names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        logits, grads = _logits_and_grads(reference_model, input_ids)
    reference_model.eval()
    assert max_rel_diff(logits, expected_logits) <= 1e-5
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        rel = max_rel_diff(grad, expected_grads[name])
        assert rel <= 1e-5, f"{name}: max relative diff {rel:.2e}"


def test_patched_greedy_generate_is_identical(reference_model):
    prompt = _inputs(batch=2, length=12, seed=1)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = reference_model.generate(prompt, **kwargs)
    with patch_gpt_oss_experts(reference_model):
        actual = reference_model.generate(prompt, **kwargs)
    assert torch.equal(actual, expected)


def test_handle_reverts_and_checkpoint_is_unchanged(reference_model, tmp_path):
    input_ids = _inputs(batch=1, length=16)
    with torch.no_grad():
        before = reference_model(input_ids).logits
    keys_before = {k: v.shape for k, v in reference_model.state_dict().items()}
    handle = patch_gpt_oss_experts(reference_model)
    assert {k: v.shape for k, v in reference_model.state_dict().items()} == keys_before
    reference_model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no GptOssExperts module to patch"):
        patch_gpt_oss_experts(reference_model)
    handle.revert()
    experts = [m for m in reference_model.modules() if isinstance(m, GptOssExperts)]
    assert experts and all(type(m) is GptOssExperts and "layer_name" not in vars(m) for m in experts)
    with torch.no_grad():
        assert torch.equal(reference_model(input_ids).logits, before)
        reloaded = GptOssForCausalLM.from_pretrained(tmp_path, experts_implementation="eager").eval()
        assert torch.equal(reloaded(input_ids).logits, before)


def test_experts_interface_registration_dispatches_here():
    model = tiny_gpt_oss(seed=4)
    input_ids = _inputs(batch=1, length=16)
    model.set_experts_implementation("eager")
    with torch.no_grad():
        expected = model(input_ids).logits
    model.set_experts_implementation(SEQUENTIAL_EXPERTS)
    with torch.no_grad():
        assert max_rel_diff(model(input_ids).logits, expected) <= 1e-6
    experts = model.model.layers[0].mlp.experts
    assert not isinstance(experts, GptOssSequentialExperts)
    bad_index = torch.full((3, 2), 4)  # 4 experts: index 4 is out of range; only our path raises ValueError
    with pytest.raises(ValueError, match=r"router_indices must lie in \[0, 4\)"):
        experts(torch.zeros(3, 128), bad_index, torch.ones(3, 2))


def test_float64_model_runs_patched():
    """Upstream's default grouped_mm rejects float64; the patched model runs it and matches eager."""
    model = tiny_gpt_oss(seed=5, dtype=torch.float64)
    model.set_experts_implementation("eager")
    input_ids = _inputs(batch=1, length=24)
    with torch.no_grad():
        expected = model(input_ids).logits
        with patch_gpt_oss_experts(model):
            actual = model(input_ids).logits
    assert max_rel_diff(actual, expected) <= 1e-12
