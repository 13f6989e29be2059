"""A whole tiny GPT-OSS with token tiles against the plain path: logits, loss and every gradient (sinks,
router, experts, norms, LoRA adapters), with and without gradient checkpointing.

Which comparisons are exact: the output of a tile is the same row-wise arithmetic, but the experts regroup
their rows per tile (other matmul shapes) and every parameter gradient is summed per tile and then across
tiles, so nothing is bit-identical here (the RMSNorm alone is: ``test_tiles.py``). The bounds: logits, loss
and each gradient within 1e-6 relative of the plain path; a gradient beyond that (measured: up to 1.2e-6, a
key bias at one-token tiles, where the plain fp32 path itself is 1.3e-6 from float64) must be no farther from
the float64 path than twice the plain fp32 path is.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.long_context.helpers import rel, step, tiny_model, token_ids

TILES = {"one_token": 1, "prime": 7, "larger_than_input": 64}


def _check_against_plain(model, *, token_tile, checkpointing):
    ids = token_ids(model.config.vocab_size)
    logits, loss, grads, _ = step(model, ids, checkpointing=checkpointing, token_tile=token_tile)
    plain_logits, plain_loss, plain_grads, _ = step(model, ids, checkpointing=checkpointing)
    _, _, grads64, _ = step(copy.deepcopy(model).double(), ids, checkpointing=checkpointing)
    assert rel(logits, plain_logits) <= 1e-6, f"logits {rel(logits, plain_logits):.2e}"
    assert rel(loss, plain_loss) <= 1e-6, f"loss {rel(loss, plain_loss):.2e}"
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        if rel(grad, plain_grads[name]) <= 1e-6:
            continue
        own_error, tiled_error = rel(plain_grads[name], grads64[name]), rel(grad, grads64[name])
        assert tiled_error <= 2 * own_error + 1e-7, (
            f"{name}: {rel(grad, plain_grads[name]):.2e} from plain; from float64 tiled {tiled_error:.2e}, "
            f"plain {own_error:.2e}"
        )
    return grads


@pytest.mark.parametrize("tile", list(TILES.values()), ids=list(TILES))
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "no_checkpointing"])
def test_tiled_layers_equal_the_plain_path(tile, checkpointing):
    grads = _check_against_plain(tiny_model(), token_tile=tile, checkpointing=checkpointing)
    for part in ("self_attn.sinks", "mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj"):
        assert any(name.endswith(part) for name in grads), f"no gradient for {part}"


@pytest.mark.parametrize("tile", [1, 7], ids=["one_token", "prime"])
def test_tiled_layers_equal_the_plain_path_with_lora(tile):
    grads = _check_against_plain(tiny_model(lora=True), token_tile=tile, checkpointing=True)
    adapters = [name for name in grads if "lora_" in name]
    # q, k, v, o and both expert parameters, A and B each, in every layer
    assert len(adapters) == 4 * 6 * 2, adapters
    assert all(grads[name].abs().max() > 0 for name in adapters)


def test_eval_forward_in_tiles_equals_the_plain_path():
    model = tiny_model().eval()
    ids = token_ids(model.config.vocab_size)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        from trl_gptoss.long_context import enable_long_context

        with enable_long_context(model, token_tile=5):
            tiled = model(input_ids=ids).logits
        reverted = model(input_ids=ids).logits
    assert rel(tiled, plain) <= 1e-6
    assert torch.equal(reverted, plain)
