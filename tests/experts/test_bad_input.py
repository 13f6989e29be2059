"""Bad input raises ValueError naming the layer, the expected shape and what to change."""

from __future__ import annotations

import pytest
import torch

from tests.experts.helpers import random_routing, upstream_experts
from trl_gptoss.experts import patch_gpt_oss_experts, sequential_experts
from trl_gptoss.testing import tiny_gpt_oss

NUM_TOKENS = 5


@pytest.fixture
def experts():
    module = upstream_experts(4, dtype=torch.float32)
    patch_gpt_oss_experts(module)
    return module


def _good():
    hidden = torch.randn(NUM_TOKENS, 32)
    index, weights = random_routing(NUM_TOKENS, 4, 2, dtype=torch.float32)
    return hidden, index, weights


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda h, i, w: (h, i + 4, w), r"experts: router_indices must lie in \[0, 4\).*\[4, 7\]"),
        (lambda h, i, w: (h, i - 3, w), r"router_indices must lie in \[0, 4\)"),
        (lambda h, i, w: (h, i, w[:, :1]), r"routing_weights must have shape \(5, 2\).*got \(5, 1\)"),
        (lambda h, i, w: (h, i, w.double()), r"routing_weights has dtype torch.float64.*cast"),
        (lambda h, i, w: (h.bfloat16(), i, w.bfloat16()), r"gate_up_proj has dtype torch.float32.*bfloat16"),
        (lambda h, i, w: (h, i.float(), w), r"router_indices must be an integer tensor"),
        (lambda h, i, w: (h, i[:3], w[:3]), r"router_indices must have shape \[5, K\]"),
        (lambda h, i, w: (h.reshape(1, 5, 32), i, w), r"hidden_states must be \[num_tokens, 32\]"),
        (lambda h, i, w: (h, torch.zeros(5, 5, dtype=torch.long), torch.zeros(5, 5)), r"1 <= K <= 4"),
        (lambda h, i, w: (h, None, None), r"router_indices and routing_weights are required"),
    ],
    ids=["index_too_high", "index_negative", "weights_shape", "weights_dtype", "hidden_dtype", "float_index",
         "token_count", "hidden_rank", "top_k_too_large", "missing_routing"],
)
def test_bad_input_raises(experts, mutate, message):
    with pytest.raises(ValueError, match=message):
        experts(*mutate(*_good()))


def test_error_names_the_model_layer():
    model = tiny_gpt_oss()
    patch_gpt_oss_experts(model)
    experts = model.model.layers[1].mlp.experts
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts: router_indices must lie in \[0, 4\)"):
        experts(torch.randn(3, 128), torch.full((3, 2), 9), torch.ones(3, 2))


def test_bad_parameter_shapes_and_chunk_size():
    hidden, index, weights = _good()
    w1, b1, w2, b2 = torch.zeros(4, 32, 48), torch.zeros(4, 48), torch.zeros(4, 24, 32), torch.zeros(4, 32)
    with pytest.raises(ValueError, match=r"L3: down_proj_bias must have shape \(4, 32\), got \(4, 31\)"):
        sequential_experts(hidden, index, weights, w1, b1, w2, torch.zeros(4, 31), alpha=1.7, limit=7.0,
                           layer_name="L3")
    with pytest.raises(ValueError, match="rows_per_chunk must be a positive int"):
        sequential_experts(hidden, index, weights, w1, b1, w2, b2, alpha=1.7, limit=7.0, rows_per_chunk=0)
    with pytest.raises(ValueError, match="rows_per_chunk must be a positive int"):
        patch_gpt_oss_experts(tiny_gpt_oss(), rows_per_chunk=-1)
