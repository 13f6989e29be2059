"""Token-wise parts of a layer run in token tiles, each tile recomputed alone in backward.

``map_token_tiles(fn, hidden, tile_tokens)`` applies a token-wise ``fn`` (each output row depends only on the
same input row: RMSNorm, router, experts) to ``hidden [B, T, H]`` tile by tile. Under grad each tile runs
inside its own non-reentrant ``torch.utils.checkpoint``: the forward keeps only the tile's input (a view of
``hidden``, no copy), and backward recomputes one tile at a time, so the tensors ``fn`` saves for its backward
(an RMSNorm's fp32 input and product, the experts' ``[n*K, 2I]`` pre-activations) exist for one tile only.
Nested inside the layer's own gradient checkpoint this is torch's supported checkpoint nesting.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def token_tiles(num_tokens: int, tile_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each tile: ``tile_tokens`` rows each, the last one shorter (none for no tokens)."""
    return [(start, min(start + tile_tokens, num_tokens)) for start in range(0, num_tokens, tile_tokens)]


def map_token_tiles(fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """``fn(hidden)`` computed on tiles of ``tile_tokens`` tokens: ``hidden [B, T, H]`` → ``[B, T, H']``.

    ``fn`` receives ``[1, n, H]`` (batch and sequence flattened, so a tile may span two rows of the batch) and
    returns ``[1, n, H']``. Without grad the tiles run plainly (their temporaries still exist one tile at a
    time). The tiles' outputs are concatenated: one ``[B*T, H']`` copy exists next to the tiles' outputs
    until ``cat`` returns.
    """
    leading, width = hidden.shape[:-1], hidden.shape[-1]
    rows = hidden.reshape(-1, width)
    record = torch.is_grad_enabled()
    outputs = []
    for start, end in token_tiles(rows.shape[0], tile_tokens):
        tile = rows[start:end].unsqueeze(0)
        out = checkpoint(fn, tile, use_reentrant=False) if record else fn(tile)
        outputs.append(out.squeeze(0))
    if not outputs:  # no tokens: fn on the empty input keeps its output width
        return fn(rows.unsqueeze(0)).reshape(*leading, -1)
    return torch.cat(outputs).reshape(*leading, -1)
