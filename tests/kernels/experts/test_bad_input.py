"""Bad input to ``sequential_experts`` raises an error naming the layer, the argument and what to change."""

from __future__ import annotations

import pytest
import torch

from gptoss_kernels.experts import ExpertParams, sequential_experts
from tests.kernels.experts.helpers import random_routing

NUM_TOKENS = 5


def _params(dtype=torch.float32, **replace):
    params = ExpertParams(torch.zeros(4, 32, 48), torch.zeros(4, 48), torch.zeros(4, 24, 32), torch.zeros(4, 32))
    return ExpertParams(*(p.to(dtype) for p in params))._replace(**replace)


def _run(hidden, index, weights, params=None, **kwargs):
    params = _params() if params is None else params
    return sequential_experts(hidden, index, weights, params, alpha=1.702, limit=7.0, layer_name="L3", **kwargs)


def _good():
    hidden = torch.randn(NUM_TOKENS, 32)
    index, weights = random_routing(NUM_TOKENS, 4, 2, dtype=torch.float32)
    return hidden, index, weights


def _with_nan(w):
    w = w.clone()
    w[3, 1] = float("nan")
    return w


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda h, i, w: (h, i + 4, w), r"L3: router_indices must lie in \[0, 4\).*\[4, 7\]"),
        (lambda h, i, w: (h, i - 3, w), r"router_indices must lie in \[0, 4\)"),
        (lambda h, i, w: (h, i, w[:, :1]), r"routing_weights must have shape \(5, 2\).*got \(5, 1\)"),
        (lambda h, i, w: (h, i, w.double()), r"routing_weights has dtype torch.float64.*cast"),
        (lambda h, i, w: (h.bfloat16(), i, w.bfloat16()), r"gate_up_proj has dtype torch.float32.*bfloat16"),
        (lambda h, i, w: (h, i.float(), w), r"router_indices must be an integer tensor"),
        (lambda h, i, w: (h, i[:3], w[:3]), r"router_indices must have shape \[5, K\]"),
        (lambda h, i, w: (h.reshape(1, 5, 32), i, w), r"hidden_states must be \[num_tokens, 32\]"),
        (lambda h, i, w: (h.int(), i, w), r"hidden_states must be floating point"),
        (lambda h, i, w: (h, torch.zeros(5, 5, dtype=torch.long), torch.zeros(5, 5)), r"1 <= K <= 4"),
        (lambda h, i, w: (h, None, None), r"router_indices and routing_weights are required"),
        (lambda h, i, w: (h, i, _with_nan(w)), r"L3: routing_weights has 1 NaN or infinite value"),
        (lambda h, i, w: (h, i, w / 0), r"routing_weights has 10 NaN or infinite value"),
    ],
    ids=[
        "index_too_high",
        "index_negative",
        "weights_shape",
        "weights_dtype",
        "hidden_dtype",
        "float_index",
        "token_count",
        "hidden_rank",
        "integer_hidden",
        "top_k_too_large",
        "missing_routing",
        "nan_weight",
        "infinite_weights",
    ],
)
def test_bad_routing_raises(mutate, message):
    with pytest.raises(ValueError, match=message):
        _run(*mutate(*_good()))


@pytest.mark.parametrize(
    "replace, message",
    [
        (dict(down_proj_bias=torch.zeros(4, 31)), r"L3: down_proj_bias must have shape \(4, 32\), got \(4, 31\)"),
        (dict(gate_up_proj_bias=torch.zeros(3, 48)), r"gate_up_proj_bias must have shape \(4, 48\)"),
        (dict(down_proj=torch.zeros(4, 32, 24)), r"down_proj must have shape \(4, 24, 32\), got \(4, 32, 24\)"),
        (dict(gate_up_proj=torch.zeros(4, 32, 47)), r"gate_up_proj must be \[E, H, 2I\], got \(4, 32, 47\)"),
        (dict(gate_up_proj=torch.zeros(32, 48)), r"gate_up_proj must be \[E, H, 2I\]"),
    ],
    ids=["down_bias", "gate_up_bias_experts", "down_transposed", "odd_gate_up", "gate_up_rank"],
)
def test_bad_parameter_shapes_raise(replace, message):
    with pytest.raises(ValueError, match=message):
        _run(*_good(), params=_params(**replace))


def test_params_must_be_the_named_type_and_chunks_positive():
    hidden, index, weights = _good()
    with pytest.raises(TypeError, match="L3: params must be an ExpertParams, got tuple"):
        _run(hidden, index, weights, params=tuple(_params()))
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="rows_per_chunk must be a positive int or None"):
            _run(hidden, index, weights, rows_per_chunk=bad)


def test_finite_weights_and_in_range_indices_pass():
    """The checks above are not trigger-happy: zeros, exact ones and the boundary experts 0 and E-1 run."""
    hidden = torch.randn(2, 32)
    index = torch.tensor([[0, 3], [3, 0]], dtype=torch.int32)
    out = _run(hidden, index, torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert out.shape == (2, 32) and torch.isfinite(out).all()
