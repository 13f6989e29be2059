"""Sink-aware Ulysses attention, registered with transformers under ``"ulysses_<inner>"``.

Per layer, inside a ``sharded_forward`` context (rank r of n holds tokens ``[r*T/n, (r+1)*T/n)``)::

    q [B, Hq, T/n, D] --all-to-all--> [B, Hq/n, T, D]      rank r: query heads [r*Hq/n, (r+1)*Hq/n)
    k, v likewise; KV heads are split when n <= Hkv and first repeated (n/Hkv)x when n > Hkv, so the
    all-to-all hands each rank exactly the KV head its query heads read
    sinks[r*Hq/n : (r+1)*Hq/n]   sliced differentiably: rank r's gradient lands in its own slice, and the
                                 SP-group sum done by DDP/FSDP2 assembles the full sinks gradient
    o = inner(q, k, v, sinks_r) on the whole (packed) sequence, documents and sliding window taken from
    the all-gathered position_ids
    o [B, T, Hq/n, D] --all-to-all--> [B, T/n, Hq, D]

Outside the context (generation, evaluation, any unsharded pass) the wrapper calls the inner attention
unchanged, with the mask transformers built for it, so the model behaves exactly as with ``inner``.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from trl_gptoss.parallel.comm import gather_sequence_no_grad, heads_to_seq, seq_to_heads
from trl_gptoss.parallel.config import SINK_AWARE_INNER_ATTENTIONS
from trl_gptoss.parallel.groups import SequenceParallelGroup
from trl_gptoss.parallel.masks import additive_mask

NAME_PREFIX = "ulysses_"


@dataclass
class _ShardedForward:
    """State of one sharded forward: the SP group and the positions gathered once, reused by every layer."""

    sp: SequenceParallelGroup
    local_positions: torch.Tensor | None = None
    global_positions: torch.Tensor | None = None

    def positions(self, local: torch.Tensor, batch: int) -> torch.Tensor:
        """``local: [B or 1, T/n]`` -> global ``[B, T]`` (every layer passes the same tensor object)."""
        if local is not self.local_positions:
            expanded = local.expand(batch, -1)
            gathered = gather_sequence_no_grad(expanded.transpose(0, 1).contiguous(), self.sp)
            self.local_positions, self.global_positions = local, gathered.transpose(0, 1)
        return self.global_positions


_ACTIVE: ContextVar[_ShardedForward | None] = ContextVar("trl_gptoss_sharded_forward", default=None)


@contextlib.contextmanager
def sharded_forward(sp: SequenceParallelGroup):
    """Run the model's forward with each rank holding ``T/n`` consecutive tokens of the same rows."""
    token = _ACTIVE.set(_ShardedForward(sp))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def select_local_sinks(sinks: torch.Tensor, rank: int, heads_per_rank: int) -> torch.Tensor:
    """The sinks of the query heads rank ``rank`` holds after the all-to-all (a differentiable view)."""
    return sinks[rank * heads_per_rank : (rank + 1) * heads_per_rank]


class _HeadSliceView:
    """Stands in for a ``GptOssAttention`` inside the inner attention: same attributes, but only this rank's
    sinks and GQA ratio. The module itself is never mutated, so a bypassed call still sees the full one."""

    def __init__(self, module, sinks: torch.Tensor, num_key_value_groups: int):
        self._module = module
        self.sinks = sinks
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def attention_name(inner: str) -> str:
    return NAME_PREFIX + inner


def _inner_of(module) -> str:
    return module.config._attn_implementation.removeprefix(NAME_PREFIX)


def _inner_function(inner: str):
    if inner == "eager":
        return eager_attention_forward
    if inner not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"inner attention {inner!r} is not registered with transformers; import trl_gptoss first")
    return ALL_ATTENTION_FUNCTIONS[inner]


def _split_kv_for_ranks(key, value, n: int):
    """Repeat KV heads when there are fewer than ranks, so the all-to-all gives each rank the one it needs."""
    hkv = key.shape[1]
    if n <= hkv:
        return key, value
    return key.repeat_interleave(n // hkv, dim=1), value.repeat_interleave(n // hkv, dim=1)


def ulysses_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface entry. ``query: [B, Hq, T/n, D]``, ``key/value: [B, Hkv, T/n, D]`` ->
    ``([B, T/n, Hq, D], None)``. ``kwargs``: ``sliding_window``, ``s_aux`` (sinks), ``position_ids``."""
    inner = _inner_of(module)
    state = _ACTIVE.get()
    if state is None:
        return _inner_function(inner)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    sp, local_positions = state.sp, kwargs.pop("position_ids", None)
    if local_positions is None:
        raise ValueError("a sharded forward needs position_ids (each rank's slice of the packed positions)")
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"a sharded forward attends within the sequence ({query.shape[2]} queries, "
            f"{key.shape[2]} keys); call the model with use_cache=False and no past_key_values"
        )
    hq = query.shape[1]
    if hq % sp.size:
        raise ValueError(f"num_attention_heads={hq} must be a multiple of sp_size={sp.size}")
    key, value = _split_kv_for_ranks(key, value, sp.size)
    query, key, value = (seq_to_heads(t, sp) for t in (query, key, value))
    sinks = kwargs.pop("s_aux", None)
    sinks = select_local_sinks(module.sinks if sinks is None else sinks, sp.rank, hq // sp.size)
    view = _HeadSliceView(module, sinks, query.shape[1] // key.shape[1])
    positions = state.positions(local_positions, query.shape[0])
    window = kwargs.pop("sliding_window", None)
    for local_only in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(local_only, None)  # documents are taken from the gathered positions instead
    if inner == "eager":
        # rebuilt per layer rather than cached: an O(T^2) mask per window held for the whole forward would
        # not shrink with sp (eager's backward does not keep it)
        mask = additive_mask(positions, window, query.dtype)
        out, _ = eager_attention_forward(view, query, key, value, mask, scaling=scaling, dropout=dropout)
        del mask
    else:
        out, _ = _inner_function(inner)(
            view,
            query,
            key,
            value,
            None,
            scaling=scaling,
            dropout=dropout,
            sliding_window=window,
            s_aux=sinks,
            position_ids=positions,
            **kwargs,
        )
    return heads_to_seq(out, sp), None


def _ulysses_mask(inner: str):
    """Mask factory: the inner's own mask when bypassed; nothing when sharded (the wrapper builds the global
    structure from gathered positions, so no ``[T/n, T/n]`` local mask is ever materialised)."""

    def mask_function(**kwargs):
        if _ACTIVE.get() is not None:
            padding = kwargs.get("attention_mask")
            if padding is not None and not bool(padding.all()):
                raise ValueError("a sharded forward takes packed rows without padding mask; pack the batch first")
            return None
        if inner in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            return ALL_MASK_ATTENTION_FUNCTIONS[inner](**kwargs)
        return None

    return mask_function


def register_ulysses_attention(inner: str) -> str:
    """Register ``"ulysses_<inner>"`` with transformers' attention and mask interfaces; return the name."""
    if inner not in SINK_AWARE_INNER_ATTENTIONS:
        raise ValueError(
            f"inner attention {inner!r} cannot take per-head sinks; use one of {SINK_AWARE_INNER_ATTENTIONS}"
        )
    _inner_function(inner)  # fail early if the inner kernel is not registered
    name = attention_name(inner)
    AttentionInterface.register(name, ulysses_attention_forward)
    AttentionMaskInterface.register(name, _ulysses_mask(inner))
    return name
