"""Turn transformers' padded / packed batches into the layouts sink attention takes.

Training and prefill (``Tq == Tk``): the valid tokens of every row (from the 2-D padding mask) are cut
into documents wherever ``position_ids`` restart (TRL's padding-free collator, or any packing), and
gathered into one packed ``[total, H, D]`` sequence with ``cu_seqlens``; documents never see each other.
Decoding with a cache (``Tq < Tk``): each row's valid keys are one contiguous span and its queries are
the last positions of that span, so every row is a batched ``B = 1`` problem with ``Tq' <= Tk'``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedLayout:
    """Where the packed tokens come from: ``token_index`` into the flattened ``[B * T]`` rows."""

    token_index: torch.Tensor  # int64 [total]
    cu_seqlens: torch.Tensor  # int32 [n_docs + 1]
    max_seqlen: int


def valid_spans(mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per row of a 2-D keep-mask ``[B, T]`` the span ``[start, end)`` of its valid tokens.

    Left and right padding give one contiguous span per row; anything else (holes inside a row) has no
    varlen equivalent of eager's masking, so it is refused rather than silently changed.
    """
    mask = mask.bool()
    batch, seqlen = mask.shape
    run_starts = mask & ~torch.nn.functional.pad(mask, (1, 0))[:, :seqlen]
    if bool((run_starts.sum(dim=1) > 1).any()):
        raise ValueError("attention_mask has padding holes inside a row; fa3_sink supports left or right padding "
                         "(one contiguous span of valid tokens per row). Pack documents with position_ids instead.")
    counts = mask.sum(dim=1)
    starts = torch.where(counts > 0, mask.int().argmax(dim=1), torch.zeros_like(counts))
    return starts.tolist(), (starts + counts).tolist()


def _doc_starts(valid: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Bool ``[B, T]``: token t opens a document (first valid token of its row, or a position reset)."""
    batch, seqlen = valid.shape
    prev_valid = torch.nn.functional.pad(valid, (1, 0))[:, :seqlen]
    starts = valid & ~prev_valid
    if position_ids is not None:
        pos = position_ids.expand(batch, seqlen)
        reset = torch.zeros_like(valid)
        reset[:, 1:] = pos[:, 1:] <= pos[:, :-1]
        starts |= valid & reset
    return starts


def packed_layout(batch: int, seqlen: int, attention_mask, position_ids, device) -> PackedLayout | None:
    """The packed layout of a ``Tq == Tk`` batch, or None when it is plain (no padding, no packing).

    ``attention_mask``: None or 2-D keep-mask ``[B, T]``. ``position_ids``: None or ``[1|B, T]``.
    """
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[-1] != seqlen):
        position_ids = None  # not the 1-D-rope layout GPT-OSS uses; packing is then not inferred from it
    valid = torch.ones(batch, seqlen, dtype=torch.bool, device=device)
    if attention_mask is not None:
        valid_spans(attention_mask)
        valid = attention_mask.bool().to(device)
    starts = _doc_starts(valid, position_ids)
    if attention_mask is None and int(starts.sum()) == batch:
        return None
    flat_valid = valid.reshape(-1)
    token_index = flat_valid.nonzero().squeeze(1)
    doc_starts = starts.reshape(-1)[token_index].nonzero().squeeze(1)
    total = token_index.numel()
    cu_seqlens = torch.cat([doc_starts, doc_starts.new_tensor([total])]).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    return PackedLayout(token_index=token_index, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


def layout_from_cu_seqlens(cu_seq_lens_q, cu_seq_lens_k, max_length_q, seqlen, device) -> PackedLayout:
    """The packed layout handed over by TRL's padding-free collator (``cu_seq_lens_q/k`` kwargs, B == 1)."""
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_q.cpu(), cu_seq_lens_k.cpu()):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ; fa3_sink needs the same documents for queries "
                         "and keys (self-attention over packed documents)")
    cu_seqlens = cu_seq_lens_q.to(device=device, dtype=torch.int32)
    if int(cu_seqlens[-1]) != seqlen:
        raise ValueError(f"cu_seq_lens_q[-1]={int(cu_seqlens[-1])} must equal the packed length {seqlen}")
    max_seqlen = int(max_length_q) if max_length_q is not None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedLayout(token_index=torch.arange(seqlen, device=device), cu_seqlens=cu_seqlens,
                        max_seqlen=max_seqlen)
