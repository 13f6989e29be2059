"""Routing records that cannot drive the model raise ValueError naming the layer and the expected shape."""

from __future__ import annotations

import pytest
import torch

from trl_gptoss.experts.routing import RoutingRecord, compact_index_dtype, record_routing, replay_routing
from trl_gptoss.testing import tiny_gpt_oss

TOKENS = 10


@pytest.fixture(scope="module")
def model():
    return tiny_gpt_oss(seed=1)


@pytest.fixture(scope="module")
def record(model):
    with torch.no_grad(), record_routing(model) as rec:
        model(torch.arange(TOKENS)[None])
    return rec


def test_record_from_another_model_shape(record):
    other = tiny_gpt_oss(num_local_experts=8)
    with pytest.raises(ValueError, match=r"another model.*\(2, 4, 2, 128\).*\(2, 8, 2, 128\).*\[num_tokens, 2\]"):
        replay_routing(other, record)


def test_replay_with_a_different_token_count(model, record):
    with (
        replay_routing(model, record),
        pytest.raises(ValueError, match=r"layer 0 \(model\.layers\.0\.mlp\.router\).*shape \[12, 2\], got \(10, 2\)"),
    ):
        model(torch.arange(12)[None])


def test_out_of_range_and_wrong_shape_indices(model):
    good = [torch.zeros(TOKENS, 2, dtype=torch.long), torch.ones(TOKENS, 2, dtype=torch.long)]
    with pytest.raises(ValueError, match=r"layer 1 \(model\.layers\.1\.mlp\.router\): expert ids must lie in \[0, 4\)"):
        RoutingRecord.from_layer_indices(model, [good[0], good[1] + 4])
    with pytest.raises(ValueError, match=r"layer 0 .*shape \[num_tokens, 2\], got \(10, 3\)"):
        RoutingRecord.from_layer_indices(model, [torch.zeros(TOKENS, 3, dtype=torch.long), good[1]])
    with pytest.raises(ValueError, match="must be integers"):
        RoutingRecord.from_layer_indices(model, [good[0].float(), good[1]])
    with pytest.raises(ValueError, match="routing for 1 layers, the model has 2 routers"):
        RoutingRecord.from_layer_indices(model, good[:1])


def test_incomplete_record_and_bad_format(model, record):
    partial = RoutingRecord.empty_for(model)
    partial.indices[0] = record.indices[0]
    with pytest.raises(ValueError, match=r"no indices for layer 1 \(model\.layers\.1\.mlp\.router\)"):
        replay_routing(model, partial)
    state = record.to_dict() | {"format_version": 99}
    with pytest.raises(ValueError, match="format_version 99"):
        RoutingRecord.from_dict(state)
    with pytest.raises(ValueError, match="needs a RoutingRecord"):
        replay_routing(model, record.to_dict())
    with pytest.raises(ValueError, match=r"cannot take rows \[5, 15\)"):
        record.narrow(5, 10)


def test_recording_two_different_forwards_raises(model):
    with pytest.raises(ValueError, match="routed twice"), torch.no_grad(), record_routing(model):
        model(torch.arange(TOKENS)[None])
        model(torch.arange(TOKENS, 2 * TOKENS)[None])


def test_compact_dtype_and_non_gpt_oss_model():
    assert compact_index_dtype(32) == torch.uint8 and compact_index_dtype(256) == torch.uint8
    assert compact_index_dtype(257) == torch.int16
    with pytest.raises(ValueError, match="at most 32768"):
        compact_index_dtype(40000)
    with pytest.raises(ValueError, match="no GptOssTopKRouter"):
        record_routing(torch.nn.Linear(2, 2))
