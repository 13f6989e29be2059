"""``GptOssSequentialExperts`` (the patched module) vs upstream ``GptOssExperts``; errors name the model layer."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.kernels.experts.helpers import GRAD_NAMES, forward_and_grads, max_rel_diff, random_routing, upstream_experts
from trl_gptoss.experts import GptOssSequentialExperts, patch_gpt_oss_experts
from trl_gptoss.testing import tiny_gpt_oss


@pytest.mark.parametrize("rows_per_chunk", [None, 5], ids=["one_matmul_per_expert", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_patched_module_matches_upstream(dtype, rows_per_chunk):
    reference = upstream_experts(4, dtype=dtype)
    patched = copy.deepcopy(reference)
    handle = patch_gpt_oss_experts(patched, rows_per_chunk=rows_per_chunk)
    assert isinstance(patched, GptOssSequentialExperts) and handle.module_names == ["experts"]
    assert patched.rows_per_chunk == rows_per_chunk
    hidden = torch.randn(37, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)
    index, weights = random_routing(37, 4, 2, dtype=dtype)
    expected = forward_and_grads(reference, reference, hidden, index, weights)
    actual = forward_and_grads(patched, patched, hidden, index, weights)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    for name, got, want in zip(GRAD_NAMES, actual, expected):
        rel = max_rel_diff(got, want)
        assert rel <= tolerance, f"{name}: max relative diff {rel:.2e} > {tolerance:.0e}"


def test_errors_name_the_model_layer():
    model = tiny_gpt_oss()
    patch_gpt_oss_experts(model)
    experts = model.model.layers[1].mlp.experts
    hidden = torch.randn(3, 128)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts: router_indices must lie in \[0, 4\)"):
        experts(hidden, torch.full((3, 2), 9), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts: routing_weights has 1 NaN"):
        experts(hidden, torch.tensor([[0, 1]] * 3), torch.tensor([[0.5, 0.5], [0.5, float("nan")], [1.0, 0.0]]))
    with pytest.raises(ValueError, match=r"router_indices and routing_weights are required, both \[3, K\]"):
        experts(hidden)


def test_patch_rejects_a_bad_chunk_size():
    with pytest.raises(ValueError, match="rows_per_chunk must be a positive int or None, got -1"):
        patch_gpt_oss_experts(tiny_gpt_oss(), rows_per_chunk=-1)
