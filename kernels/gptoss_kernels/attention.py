"""Public sink attention: validate once, pick a backend from one table, log the choice once per backend.

Each backend is a row ``name -> supports(call) -> reason it cannot run | None, run(call) -> o``.
``backend="auto"`` takes the first row of ``AUTO_ORDER`` that supports the call: FA4 (``flash-attn-4`` on
SM90+, when it supports the case) -> the package's Triton kernel (CUDA; batched inputs, ``Tq <= Tk``, are
flattened to its packed layout) -> the chunked PyTorch path (CPU, float64, head_dim > 128, and padding masks
with holes; under ``auto`` its full-causal batched fp32/fp64 CPU calls run torch's fused CPU flash kernel
plus a sink rescale, ``fused_cpu.py``, with torch SDPA's memory). What Triton can run is decided by one
rule, ``validation.triton_unsupported``, which the Triton entry point applies too.
Explicit ``"fa4" | "triton" | "chunked" | "reference"`` force one row; a forced backend that cannot run the
case raises ``ValueError`` instead of silently falling back.
Under ``torch.autocast`` q, k, v are cast to the autocast dtype first and every backend runs with autocast
off (``autocast.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from gptoss_kernels.autocast import autocast_inputs, autocast_off
from gptoss_kernels.chunked import DEFAULT_Q_CHUNK, run_sink_attention_chunked
from gptoss_kernels.fa4 import fa4_available, fa4_supports, sink_attention_fa4
from gptoss_kernels.fused_cpu import fused_cpu_supports, sink_attention_fused_cpu
from gptoss_kernels.reference import sink_attention_ref
from gptoss_kernels.validation import CuSeqlensInfo, check_sink_attention_inputs, triton_unsupported

logger = logging.getLogger("gptoss_kernels")

_LOGGED: set[tuple[str, str]] = set()
_KEY_MASK_TO_CHUNKED = "a key_mask (padding holes) is taken by the chunked path"


class AttentionCall(NamedTuple):
    """One validated ``sink_attention`` call as the backend rows see it (``forced``: named explicitly,
    not chosen by ``auto``; ``info``: the packed layout's ``CuSeqlensInfo``, None for batched)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None
    sinks: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    info: CuSeqlensInfo | None
    max_seqlen: int | None
    window: int | None
    scale: float | None
    key_mask: torch.Tensor | None
    forced: bool


class Backend(NamedTuple):
    """A row of the table: ``supports(call)`` is None when ``run(call)`` computes the call exactly, else the
    reason it cannot. ``auto_reason`` is logged when ``auto`` picks it (None: the reason the row before
    it in ``AUTO_ORDER`` refused)."""

    name: str
    supports: Callable[[AttentionCall], str | None]
    run: Callable[[AttentionCall], torch.Tensor]
    auto_reason: str | None = None


def _fa4_supports(call):
    if not fa4_available():
        return "flash-attn-4 is not importable on an SM90+ GPU"
    return fa4_supports(call.q, call.window) or (_KEY_MASK_TO_CHUNKED if call.key_mask is not None else None)


def _run_fa4(call):
    longest = None if call.info is None else call.max_seqlen or call.info.longest
    return sink_attention_fa4(
        call.q,
        call.k,
        call.v,
        call.sinks,
        cu_seqlens=call.cu_seqlens,
        max_seqlen=longest,
        window=call.window,
        scale=call.scale,
    )


def _triton_supports(call):
    # Interpreted CPU tensors only when named explicitly: ``auto`` never sends CPU work to the interpreter.
    return triton_unsupported(call.q, call.k, call.cu_seqlens, call.key_mask, interpreter_ok=call.forced)


def _to_packed(q, k, v):
    """Batched ``[B, Tq, H, D]`` / ``[B, Tk, H, D]`` -> packed ``[B*T, H, D]`` plus int32 cu_seqlens of the
    queries and of the keys (the same tensor when ``Tq == Tk``)."""
    batch, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    rows = torch.arange(batch + 1, device=q.device)
    cu_q = (rows * tq).to(torch.int32)
    cu_k = cu_q if tk == tq else (rows * tk).to(torch.int32)
    flat_q = q.reshape(batch * tq, *q.shape[2:])
    flat_k, flat_v = (t.reshape(batch * tk, *t.shape[2:]) for t in (k, v))
    return flat_q, flat_k, flat_v, cu_q, cu_k


def _run_triton(call):
    """The Triton autograd function (no second validation, no device->host copy)."""
    try:
        from gptoss_kernels.triton.function import run_sink_attention_triton
    except ImportError as err:
        raise ValueError(f"backend 'triton' is not available ({err}); install triton or use backend='chunked'") from err
    q, k, v = call.q, call.k, call.v
    scale = float(q.shape[-1] ** -0.5 if call.scale is None else call.scale)
    if call.info is not None:
        longest = call.max_seqlen or call.info.longest
        return run_sink_attention_triton(q, k, v, call.sinks, call.cu_seqlens, longest, call.window, scale)
    qp, kp, vp, cu_q, cu_k = _to_packed(q, k, v)
    out = run_sink_attention_triton(
        qp, kp, vp, call.sinks, cu_q, q.shape[1], call.window, scale, cu_seqlens_k=cu_k, max_seqlen_k=k.shape[1]
    )
    return out.view(q.shape)


def _run_chunked(call):
    """The chunked path; under ``auto``, full causal CPU layers take torch's fused CPU kernel instead."""
    q, k, v, sinks = call.q, call.k, call.v, call.sinks
    if not call.forced and fused_cpu_supports(q, k, call.cu_seqlens, call.window, call.key_mask) is None:
        return sink_attention_fused_cpu(q, k, v, sinks, scale=call.scale)
    return run_sink_attention_chunked(
        q, k, v, sinks, call.info, call.cu_seqlens, call.window, call.scale, call.key_mask, DEFAULT_Q_CHUNK
    )


def _run_reference(call):
    return sink_attention_ref(
        call.q,
        call.k,
        call.v,
        call.sinks,
        cu_seqlens=call.cu_seqlens,
        max_seqlen=call.max_seqlen,
        window=call.window,
        scale=call.scale,
        key_mask=call.key_mask,
    )


def _always(_call):
    return None


BACKEND_TABLE: dict[str, Backend] = {
    row.name: row
    for row in (
        Backend("fa4", _fa4_supports, _run_fa4, "auto: flash-attn-4 learnable_sink on SM90+"),
        Backend("triton", _triton_supports, _run_triton, "auto: CUDA tensors"),
        Backend("chunked", _always, _run_chunked),
        Backend("reference", _always, _run_reference),
    )
}
AUTO_ORDER = ("fa4", "triton", "chunked")
BACKENDS = ("auto", *BACKEND_TABLE)


def _choose(call: AttentionCall, backend: str) -> tuple[Backend, str]:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        why_not = BACKEND_TABLE[backend].supports(call)
        if why_not:
            raise ValueError(f"backend={backend!r} cannot run this case: {why_not}; use backend='auto'")
        return BACKEND_TABLE[backend], "requested"
    why_not = None
    for name in AUTO_ORDER:
        row = BACKEND_TABLE[name]
        reason = row.supports(call)
        if reason is None:
            return row, row.auto_reason or f"auto: {why_not}"
        why_not = reason
    raise AssertionError("the last row of AUTO_ORDER supports every call")  # pragma: no cover


def select_backend(q, k, cu_seqlens, window, backend="auto", key_mask=None):
    """Return ``(backend, reason)`` for these inputs; ``ValueError`` for unknown or impossible choices."""
    call = AttentionCall(q, k, None, None, cu_seqlens, None, None, window, None, key_mask, backend != "auto")
    row, reason = _choose(call, backend)
    return row.name, reason


def _log_choice_once(backend, reason):
    if (backend, reason) not in _LOGGED:
        _LOGGED.add((backend, reason))
        logger.info("sink_attention backend: %s (%s)", backend, reason)


def sink_attention(
    q, k, v, sinks, *, cu_seqlens=None, max_seqlen=None, window=None, scale=None, key_mask=None, backend="auto"
):
    """Causal attention whose softmax denominator also holds a learnable per-head sink.

    For query row i of head h over its allowed keys j (causal; with ``window=W`` only the last W tokens
    including itself; packed documents never see each other)::

        o_i = sum_j exp(scale * q_i.k_j - lse_i) v_j,   lse_i = log(exp(sinks[h]) + sum_j exp(scale * q_i.k_j))

    Args:
        q: batched ``[B, Tq, Hq, D]`` or packed ``[total, Hq, D]`` (with ``cu_seqlens``).
        k, v: ``[B, Tk, Hkv, D]`` (``Tk >= Tq``; queries are the last Tq positions, as when decoding with
            a KV cache) or packed ``[total, Hkv, D]``; ``Hq % Hkv == 0`` (GQA).
        sinks: ``[Hq]`` logits (any float dtype; gets a gradient). ``-inf`` means "no sink".
        cu_seqlens: int32 ``[n_seqs + 1]`` document boundaries of the packed layout.
        max_seqlen: longest document (optional; computed when a kernel needs it).
        window: int >= 1 or None. scale: defaults to ``D ** -0.5``.
        key_mask: batched layout only; bool ``[B, Tk]``, False = padding key (any pattern, holes too). Every
            query row attends to its valid keys (a row that sees none returns 0). Taken by the chunked path.
        backend: ``"auto" | "fa4" | "triton" | "chunked" | "reference"``.
    Returns:
        ``o`` shaped and typed like ``q`` (under ``torch.autocast``: like q cast to the autocast dtype);
        differentiable in q, k, v and sinks.
    """
    q, k, v = autocast_inputs(q, k, v)
    info = check_sink_attention_inputs(
        q, k, v, sinks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window, key_mask=key_mask, scale=scale
    )
    call = AttentionCall(q, k, v, sinks, cu_seqlens, info, max_seqlen, window, scale, key_mask, backend != "auto")
    row, reason = _choose(call, backend)
    _log_choice_once(row.name, reason)
    with autocast_off(q.device):
        return row.run(call)
