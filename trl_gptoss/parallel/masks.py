"""Attention structure of packed rows, derived from (global) ``position_ids``.

Documents follow the one rule shared with ``fa3_sink`` (``trl_gptoss.attention.layout.document_starts``,
transformers' ``find_packed_sequence_indices``): a new document starts wherever the position does not
advance by exactly one. Padding tokens carry position 0, so each forms a document of its own.
"""

from __future__ import annotations

import torch

from trl_gptoss.attention.layout import allowed_keys as _allowed_keys
from trl_gptoss.attention.layout import document_ids as _document_ids


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``position_ids: [B, T]`` -> ``[B, T]`` int64, equal within a document, increasing along the row."""
    if position_ids.ndim != 2:
        raise ValueError(f"position_ids must be [B, T], got shape {tuple(position_ids.shape)}")
    return _document_ids(position_ids)


def allowed_keys(position_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean ``[B, 1, T, T]``: query i may see key j iff same document, ``j <= i`` and ``i - j < window``.

    ``window=W`` keeps the last W keys including the query itself (GPT-OSS / transformers semantics).
    """
    batch, seqlen = position_ids.shape
    return _allowed_keys(batch, seqlen, seqlen, window, doc_ids=document_ids(position_ids))[:, None]


def additive_mask(position_ids: torch.Tensor, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """``allowed_keys`` as the additive float mask eager attention adds to its scores (0 or dtype min)."""
    allowed = allowed_keys(position_ids, window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries of a single packed row ``[1, T]`` as int32 ``[n_docs + 1]`` (varlen kernels)."""
    if position_ids.ndim != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs one packed row [1, T], got shape {tuple(position_ids.shape)}")
    docs = document_ids(position_ids)[0]
    counts = torch.bincount(docs - 1)
    return torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
