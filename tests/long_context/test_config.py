"""The long-context config fields: bad values and combinations the options cannot serve are refused when the
config is built (before any model loads), each naming the field; the host-memory check of the offload."""

from __future__ import annotations

import pytest

from trl_gptoss.long_context.rules import (
    check_long_context_fields,
    check_offload_fits_host,
    check_offload_host_memory,
    offload_host_bytes,
)
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.trainer import GptOssGRPOConfig


def _config(**fields):
    return GptOssGRPOConfig("out", use_cpu=True, **fields)


@pytest.mark.parametrize("tile", [0, -1, 2.5, True, "512"], ids=["zero", "negative", "float", "bool", "string"])
def test_bad_token_tile_is_refused_by_name(tile):
    with pytest.raises(ValueError, match=r"long_context_token_tile must be a positive whole number"):
        _config(long_context_token_tile=tile)


def test_offload_must_be_a_bool():
    with pytest.raises(ValueError, match=r"long_context_offload_checkpoints must be true or false"):
        _config(long_context_offload_checkpoints="yes")


def test_offload_without_gradient_checkpointing_is_refused():
    with pytest.raises(ValueError, match=r"long_context_offload_checkpoints: true .* gradient_checkpointing is off"):
        _config(long_context_offload_checkpoints=True, gradient_checkpointing=False)


def test_offload_with_sequence_parallelism_is_refused():
    with pytest.raises(ValueError, match=r"long_context_offload_checkpoints: true cannot be combined with sp_size=2"):
        check_long_context_fields(
            None, True, gradient_checkpointing=True, sp_size=2, routing_replay="off", router_aux_loss_coef=0.0
        )


def test_tiles_with_routing_replay_are_refused():
    with pytest.raises(ValueError, match=r"long_context_token_tile=64 cannot be combined with routing_replay"):
        _config(long_context_token_tile=64, routing_replay="old_logprob", num_iterations=2)


def test_tiles_with_the_load_balancing_loss_are_refused():
    with pytest.raises(ValueError, match=r"long_context_token_tile=64 cannot be combined with router_aux_loss_coef"):
        _config(long_context_token_tile=64, router_aux_loss_coef=0.01)


def test_good_values_pass():
    config = _config(long_context_token_tile=4096, long_context_offload_checkpoints=True)
    assert (config.long_context_token_tile, config.long_context_offload_checkpoints) == (4096, True)


def test_offload_host_memory_says_how_much_it_needs():
    # gpt-oss-20b: 24 layers, hidden 2880, bf16 inputs: 138,240 bytes per token
    needed = offload_host_bytes(num_layers=24, hidden_size=2880, tokens=131072)
    assert needed == 24 * 2880 * 2 * 131072
    with pytest.raises(ValueError, match=r"long_context_offload_checkpoints: true needs 16\.9 GiB of pinned host"):
        check_offload_host_memory(needed, 8 * 2**30, tokens=131072)
    check_offload_host_memory(needed, 64 * 2**30, tokens=131072)


def test_offload_host_check_reads_the_model_config():
    """A model object's config sizes the need; this host has far more than a tiny model's checkpoints."""
    config = _config(long_context_offload_checkpoints=True)
    check_offload_fits_host(config, tiny_gpt_oss())
    config.per_device_train_batch_size = 2**40  # more tokens than any host holds
    with pytest.raises(ValueError, match=r"needs .* GiB of pinned host memory"):
        check_offload_fits_host(config, tiny_gpt_oss())
