"""Turn transformers' padded / packed batches into the layouts sink attention takes.

One rule for where a packed document starts, shared with ``trl_gptoss.parallel.masks`` (the eager and
Ulysses paths): transformers' ``masking_utils.find_packed_sequence_indices`` — a document starts at the
first token of a row and wherever the position does not advance by exactly one. As in transformers, packing
is read from ``position_ids`` only when there is no padding mask; a 2-D padding mask only removes keys.

- No mask, ``Tq == Tk``: documents from ``position_ids`` (or TRL's ``cu_seq_lens_*`` kwargs) -> one packed
  ``[total, H, D]`` sequence with ``cu_seqlens``; documents never see each other.
- Mask whose rows are one contiguous run each (left/right padding), ``Tq == Tk``: the valid tokens are
  packed (fast varlen path); the padding queries after a row's last valid token attend to that row's valid
  keys, as eager's do (``pad_intervals``); padding queries before it see no key and return 0.
- Any other mask (holes, or decoding ``Tq < Tk``): the batched layout with a key-validity mask.

Every layout is computed once per tensor (layers share the same ``position_ids`` / mask object) and cached,
so only the first layer of a step reads anything back from the device (under ``torch.inference_mode`` each
later layer compares the small keying tensor with a copy instead; see ``gptoss_kernels.tensor_cache``).
Layouts are built outside inference mode, so a layout first built under ``torch.inference_mode`` is also
usable by a training forward that passes the same tensor (inference tensors cannot be saved for backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptoss_kernels import row_intervals
from gptoss_kernels.tensor_cache import TensorCache


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool like ``position_ids`` ``[..., T]``: True where a document starts (first token, or the position
    does not advance by exactly one; transformers' ``find_packed_sequence_indices`` rule)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] - position_ids[..., :-1] != 1
    return starts


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` int64 ids, equal within a document and increasing along the row (1 for the first)."""
    return document_starts(position_ids).long().cumsum(dim=-1)


def allowed_keys(batch, q_len, k_len, window=None, key_mask=None, doc_ids=None) -> torch.Tensor:
    """Bool ``[B, Tq, Tk]``: query i (at position ``Tk - Tq + i``) may see key j. Causal; ``window=W`` keeps
    the last W positions including self; ``key_mask [B, Tk]`` drops padding keys; ``doc_ids [B, T]``
    (``Tq == Tk``) keeps keys of the query's own document."""
    device = key_mask.device if key_mask is not None else doc_ids.device if doc_ids is not None else None
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    allowed = allowed[None].expand(batch, q_len, k_len)
    if key_mask is not None:
        allowed = allowed & key_mask.bool()[:, None, :]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return allowed


# Keyed by the tensor object and its values (TensorCache: a write in place, inference tensors included, or a
# new tensor of the same shape is a miss).
_POSITIONS_CACHE = TensorCache()
_MASK_CACHE = TensorCache()
_CU_CACHE = TensorCache()
_CU_K_CACHE = TensorCache()


@dataclass
class PackedLayout:
    """Where the packed tokens come from: ``token_index`` into the flattened ``[B * T]`` rows (None: all,
    in order) and their documents. ``bounds`` is the host copy of ``cu_seqlens``."""

    token_index: torch.Tensor | None  # int64 [total]
    cu_seqlens: torch.Tensor  # int32 [n_docs + 1]
    max_seqlen: int
    bounds: tuple[int, ...] = ()


@dataclass
class SpanLayout:
    """A padding mask whose rows are one contiguous run of valid tokens ``[starts[b], ends[b])`` each."""

    packed: PackedLayout
    seqlen: int
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    _pad: dict = field(default_factory=dict)

    def pad_intervals(self, window, device):
        """Padding queries that see a valid key: ``(flat row index [N], RowIntervals)`` with inclusive flat key
        bounds, or None. Query i >= end of row b sees keys ``[max(start, i - W + 1), end)``."""
        if window not in self._pad:
            rows, los, his = [], [], []
            for b, (start, end) in enumerate(zip(self.starts, self.ends)):
                for i in range(end, self.seqlen if end > start else end):
                    lo = max(start, i - window + 1) if window is not None else start
                    if lo < end:
                        rows.append(b * self.seqlen + i)
                        los.append(b * self.seqlen + lo)
                        his.append(b * self.seqlen + end - 1)
            self._pad[window] = None
            if rows:
                with torch.inference_mode(False):  # usable by training forwards too (see the module docstring)
                    index = torch.tensor(rows, dtype=torch.int64, device=device)
                    self._pad[window] = (index, row_intervals(los, his, device))
        return self._pad[window]


def _packed(token_index, doc_lengths, device) -> PackedLayout:
    bounds = [0]
    for length in doc_lengths:
        bounds.append(bounds[-1] + length)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    return PackedLayout(
        token_index=token_index, cu_seqlens=cu_seqlens, max_seqlen=max(doc_lengths, default=0), bounds=tuple(bounds)
    )


def _build_packed_from_positions(batch, seqlen, position_ids, device):
    starts = document_starts(position_ids.to(device).expand(batch, seqlen)).reshape(-1)
    start_index = starts.nonzero().squeeze(1).tolist()  # the one device->host read of this step's layout
    if len(start_index) == batch:
        return None
    lengths = [b - a for a, b in zip(start_index, [*start_index[1:], batch * seqlen])]
    return _packed(None, lengths, device)


def packed_layout(batch: int, seqlen: int, position_ids, device) -> PackedLayout | None:
    """Documents of a ``Tq == Tk`` batch without padding, from ``position_ids [1|B, T]``; None when every
    row is a single document (plain batched attention). Cached per ``position_ids`` tensor."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != seqlen or seqlen == 0:
        return None  # not the 1-D-rope layout GPT-OSS uses; packing is then not inferred from it
    return _POSITIONS_CACHE.get(
        position_ids,
        (batch, seqlen, str(device)),
        lambda: _build_packed_from_positions(batch, seqlen, position_ids, device),
    )


def _build_spans(mask):
    valid = mask.bool()
    batch, seqlen = valid.shape
    run_starts = valid & ~torch.nn.functional.pad(valid, (1, 0))[:, :seqlen]
    counts = valid.sum(dim=1)
    first = torch.where(counts > 0, valid.int().argmax(dim=1), torch.zeros_like(counts))
    summary = torch.stack([run_starts.sum(dim=1), first, counts]).tolist()  # one device->host read
    if any(runs > 1 for runs in summary[0]):
        return None
    starts, counts = tuple(summary[1]), summary[2]
    ends = tuple(s + c for s, c in zip(starts, counts))
    token_index = valid.reshape(-1).nonzero().squeeze(1)
    packed = _packed(token_index, [c for c in counts if c > 0], mask.device)
    return SpanLayout(packed=packed, seqlen=seqlen, starts=starts, ends=ends)


def span_layout(attention_mask: torch.Tensor) -> SpanLayout | None:
    """The ``SpanLayout`` of a 2-D keep-mask ``[B, T]``, or None when some row has holes. Cached per mask."""
    return _MASK_CACHE.get(attention_mask, None, lambda: _build_spans(attention_mask))


def _build_from_cu(cu_seq_lens_q, max_length_q, seqlen, device):
    bounds = tuple(cu_seq_lens_q.tolist())
    if bounds[-1] != seqlen:
        raise ValueError(f"cu_seq_lens_q[-1]={bounds[-1]} must equal the packed length {seqlen}")
    longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
    max_seqlen = int(max_length_q) if max_length_q is not None else longest
    if max_seqlen < longest:
        raise ValueError(f"max_length_q={max_seqlen} is shorter than the longest document ({longest})")
    cu_seqlens = cu_seq_lens_q.to(device=device, dtype=torch.int32)
    return PackedLayout(token_index=None, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, bounds=bounds)


def layout_from_cu_seqlens(cu_seq_lens_q, cu_seq_lens_k, max_length_q, seqlen, device) -> PackedLayout:
    """The packed layout handed over by TRL's padding-free collator (``cu_seq_lens_q/k`` kwargs, B == 1).
    Cached per ``cu_seq_lens_q`` tensor; ``cu_seq_lens_k`` (when another tensor) is checked against it."""
    layout = _CU_CACHE.get(
        cu_seq_lens_q,
        (seqlen, max_length_q, str(device)),
        lambda: _build_from_cu(cu_seq_lens_q, max_length_q, seqlen, device),
    )
    other_k = cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q
    if other_k and _CU_K_CACHE.get(cu_seq_lens_k, None, lambda: tuple(cu_seq_lens_k.tolist())) != layout.bounds:
        raise ValueError(
            "cu_seq_lens_q and cu_seq_lens_k differ; fa3_sink needs the same documents for queries "
            "and keys (self-attention over packed documents)"
        )
    return layout
