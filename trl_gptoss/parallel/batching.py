"""Pack padded rows into one row, shift labels globally, pad to a multiple of ``sp`` and shard.

GRPO hands the trainer padded ``[B, L]`` batches (left-padded prompts + right-padded completions). For
sequence parallelism they become one packed row of the valid tokens, documents separated by position resets::

    input_ids   [N]   valid tokens of row 0, then row 1, ...
    positions   [N]   0..len_b-1 per row (a reset starts a new document)
    labels      [N]   labels[i] = input_ids[i+1] inside a document, -100 at each document's last token

Labels are shifted on the full row BEFORE slicing, so the token that crosses a shard boundary keeps its
label. Padding added to reach a multiple of ``sp`` has position 0 and label -100 (a document of its own that
no loss reads). ``unpack_token_values`` puts per-token values back on the ``[B, L]`` grid of the targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class PackedRows:
    """One packed row. ``target_rows/target_cols [N]``: the ``[B, L]`` cell of ``labels[i]`` (-1: none)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    target_rows: torch.Tensor
    target_cols: torch.Tensor
    shape: tuple[int, int]

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> PackedRows:
    """``input_ids, attention_mask: [B, L]`` (any padding side) -> ``PackedRows`` of the valid tokens."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
        )
    valid = attention_mask.bool()
    rows, cols = valid.nonzero(as_tuple=True)  # row-major: documents stay in order
    if rows.numel() == 0:
        raise ValueError("the batch has no valid tokens (attention_mask is all zero)")
    positions = (valid.long().cumsum(dim=1) - 1)[rows, cols]
    same_doc_next = torch.zeros_like(rows, dtype=torch.bool)
    same_doc_next[:-1] = rows[1:] == rows[:-1]
    ids = input_ids[rows, cols]
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:-1] = torch.where(same_doc_next[:-1], ids[1:], IGNORE_INDEX)
    target_rows = torch.full_like(rows, -1)
    target_cols = torch.full_like(cols, -1)
    target_rows[:-1] = torch.where(same_doc_next[:-1], rows[1:], -1)
    target_cols[:-1] = torch.where(same_doc_next[:-1], cols[1:], -1)
    return PackedRows(ids, positions, labels, target_rows, target_cols, tuple(input_ids.shape))


def pad_to_multiple(values: torch.Tensor, multiple: int, fill: int) -> torch.Tensor:
    """Right-pad ``values`` along dim 0 with ``fill`` to a length divisible by ``multiple`` (per-token rows
    ``[T, ...]`` keep their trailing shape, e.g. routes ``[T, layers, top_k]``)."""
    return pad_rows(values, values.shape[0] + (-values.shape[0] % multiple), fill)


def pad_rows(values: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """Right-pad ``values`` along dim 0 with ``fill`` to ``length`` rows (``values`` itself when it has them)."""
    extra = length - values.shape[0]
    if extra <= 0:
        return values
    return torch.cat([values, values.new_full((extra, *values.shape[1:]), fill)])


def shard(values: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of a 1-D tensor whose length is a multiple of ``size``."""
    if values.shape[0] % size:
        raise ValueError(f"length {values.shape[0]} is not a multiple of sp_size={size}; pad it first")
    length = values.shape[0] // size
    return values[rank * length : (rank + 1) * length]


def unpack_token_values(values: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """Per-packed-token ``values [N]`` (indexed like ``labels``) -> ``[B, L]`` aligned with ``input_ids``.

    Entry ``[b, t]`` holds the value predicted for token ``input_ids[b, t]`` (e.g. its log-prob); cells with
    no prediction (padding, each row's first valid token) are 0. Differentiable in ``values``.
    """
    if values.shape[0] != len(packed):
        raise ValueError(f"expected {len(packed)} per-token values, got {values.shape[0]}")
    has_target = packed.target_rows >= 0
    out = values.new_zeros(packed.shape)
    return out.index_put((packed.target_rows[has_target], packed.target_cols[has_target]), values[has_target])


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``logits [N, V]``, ``labels [N]`` -> ``log softmax(logits)[i, labels[i]]``, 0 where ignored.

    Computed in fp32 (fp64 for fp64 logits): bf16 log-softmax over a large vocabulary loses the ratio.
    """
    ignored = labels == IGNORE_INDEX
    logps = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    picked = logps.gather(-1, labels.masked_fill(ignored, 0)[:, None])[:, 0]
    return picked.masked_fill(ignored, 0.0)
