"""Layer checkpoints in host memory: bit-identical to keeping them (the same arithmetic, only the bytes
travel), the inputs really leave the device between forward and backward, at most two come back at a time."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.long_context.helpers import NUM_LAYERS, step, tiny_model, token_ids
from trl_gptoss.long_context import enable_long_context


@pytest.mark.parametrize("tile", [None, 7], ids=["whole_sequence", "prime_tiles"])
@pytest.mark.parametrize(
    ("lora", "reentrant"), [(False, False), (True, False), (False, True)], ids=["full", "lora", "reentrant"]
)
def test_offloaded_checkpoints_are_bit_identical(tile, lora, reentrant):
    model = tiny_model(lora=lora)
    ids = token_ids(model.config.vocab_size)
    logits, loss, grads, handle = step(model, ids, token_tile=tile, offload=True, reentrant=reentrant)
    kept_logits, kept_loss, kept_grads, _ = step(model, ids, token_tile=tile, reentrant=reentrant)
    assert torch.equal(logits, kept_logits) and torch.equal(loss, kept_loss)
    assert grads.keys() == kept_grads.keys()
    differing = [name for name in grads if not torch.equal(grads[name], kept_grads[name])]
    assert not differing, differing
    assert handle.offload.offloaded == NUM_LAYERS and handle.offload.kept_on_device == 0
    trained = ("lora_A", "lora_B") if lora else ("self_attn.sinks", "mlp.router.weight")
    assert all(any(part in name for name in grads) for part in trained), trained


def test_inputs_leave_the_device_and_come_back_two_at_a_time():
    model = copy.deepcopy(tiny_model())
    handle = enable_long_context(model, offload_checkpoints=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = token_ids(model.config.vocab_size)
    for _ in range(2):  # the second step reuses the host buffers
        logits = model(input_ids=ids).logits
        assert handle.offload.device_input_bytes == 0, "a layer input stayed resident after the forward"
        logits.float().square().mean().backward()
        assert handle.offload.device_input_bytes == 0, "a layer input stayed tracked after the backward"
    assert handle.offload.offloaded == 2 * NUM_LAYERS
    assert handle.offload.peak_device_inputs == 2  # the layer in backward and the next one, prefetched


def test_nothing_moves_without_a_backward_to_come():
    """Eval (no grad) and gradient checkpointing off: the inputs stay where they are."""
    model = copy.deepcopy(tiny_model())
    handle = enable_long_context(model, offload_checkpoints=True)
    ids = token_ids(model.config.vocab_size)
    model(input_ids=ids).logits.sum().backward()  # no gradient checkpointing: no checkpoint to move
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with torch.no_grad():
        model(input_ids=ids)
    assert handle.offload.offloaded == 0


def test_revert_restores_the_plain_layers():
    model = tiny_model()
    layer_class = type(model.model.layers[0])
    handle = enable_long_context(model, token_tile=3, offload_checkpoints=True)
    assert type(model.model.layers[0]) is not layer_class
    handle.revert()
    assert type(model.model.layers[0]) is layer_class
    assert "token_tile" not in vars(model.model.layers[0])


@pytest.mark.parametrize("tile", [0, -2, 2.5, True, "8"])
def test_bad_token_tile_is_refused(tile):
    with pytest.raises(ValueError, match="token_tile must be a positive whole number"):
        enable_long_context(tiny_model(), token_tile=tile)


def test_a_model_without_gpt_oss_layers_is_refused():
    with pytest.raises(ValueError, match="has no GptOssDecoderLayer"):
        enable_long_context(torch.nn.Linear(2, 2), token_tile=4)
