"""``map_token_tiles``: tile boundaries, and an RMSNorm in tiles against the whole sequence."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

from trl_gptoss.long_context.tiles import map_token_tiles, token_tiles


@pytest.mark.parametrize(
    ("num_tokens", "tile", "expected"),
    [
        (5, 1, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
        (10, 7, [(0, 7), (7, 10)]),
        (3, 8, [(0, 3)]),
        (0, 4, []),
    ],
    ids=["one_token", "prime", "tile_larger_than_input", "no_tokens"],
)
def test_token_tiles(num_tokens, tile, expected):
    assert token_tiles(num_tokens, tile) == expected


@pytest.mark.parametrize("tile", [1, 7, 100], ids=["one_token", "prime", "larger_than_input"])
def test_rmsnorm_in_tiles_is_bit_identical_except_the_weight_gradient(tile):
    """Row-wise arithmetic in unchanged order: the output and the input gradient are bit-identical in fp32.
    The weight gradient sums over tokens, per tile and then across tiles: <= 1e-6 relative."""
    norm = GptOssRMSNorm(64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2, 23, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    cotangent = torch.randn(2, 23, 64, generator=torch.Generator().manual_seed(2))

    def grads(run):
        norm.zero_grad(set_to_none=True)
        out = run()
        (d_hidden,) = torch.autograd.grad((out * cotangent).sum(), hidden, retain_graph=True)
        (out * cotangent).sum().backward()
        return out.detach(), d_hidden, norm.weight.grad.clone()

    plain = grads(lambda: norm(hidden))
    tiled = grads(lambda: map_token_tiles(norm, hidden, tile))
    assert torch.equal(tiled[0], plain[0]), "output"
    assert torch.equal(tiled[1], plain[1]), "d_hidden"
    weight_rel = ((tiled[2] - plain[2]).abs().max() / plain[2].abs().max()).item()
    assert weight_rel <= 1e-6, f"d_weight {weight_rel:.2e}"


def test_tiles_keep_one_tiles_saved_tensors():
    """Under grad each tile is checkpointed: the forward keeps only the tiles' inputs (views of the input),
    where the plain norm saves its fp32 input and product."""
    norm = GptOssRMSNorm(64)
    hidden = torch.randn(1, 256, 64, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(hidden)
    plain_bytes = sum(t.numel() * t.element_size() for t in saved)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        map_token_tiles(norm, hidden, 16)
    # What the forward keeps: each tile's input, a view of the input's own storage (no new bytes).
    assert len(saved) == 256 // 16, [tuple(t.shape) for t in saved]
    assert all(t.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr() for t in saved)
    assert plain_bytes >= 2 * hidden.numel() * 4
