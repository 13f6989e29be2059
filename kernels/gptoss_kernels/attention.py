"""Public sink attention: validate once, pick a backend, log the choice once per backend.

``backend="auto"``: FA4 (``flash-attn-4`` on SM90+, when it supports the case) -> the package's Triton
kernel (CUDA; batched inputs, ``Tq <= Tk``, are flattened to its packed layout) -> the chunked PyTorch
path (CPU, float64, head_dim > 128, and padding masks with holes; under ``auto`` its full-causal batched
fp32/fp64 CPU calls run torch's fused CPU flash kernel plus a sink rescale, ``fused_cpu.py``, with torch
SDPA's memory). What Triton can run is decided by one rule, ``validation.triton_unsupported``, which the
Triton entry point applies too.
Explicit ``"fa4" | "triton" | "chunked" | "reference"`` force one; a forced backend that cannot run the
case raises ``ValueError`` instead of silently falling back.
"""

from __future__ import annotations

import logging

import torch

from gptoss_kernels.chunked import DEFAULT_Q_CHUNK, _check_tuning, _run_chunked
from gptoss_kernels.fa4 import fa4_available, fa4_supports, sink_attention_fa4
from gptoss_kernels.fused_cpu import fused_cpu_supports, sink_attention_fused_cpu
from gptoss_kernels.reference import sink_attention_ref
from gptoss_kernels.validation import check_sink_attention_inputs, triton_unsupported

logger = logging.getLogger("gptoss_kernels")

BACKENDS = ("auto", "fa4", "triton", "chunked", "reference")
_LOGGED: set[tuple[str, str]] = set()


def _log_choice_once(backend, reason):
    if (backend, reason) not in _LOGGED:
        _LOGGED.add((backend, reason))
        logger.info("sink_attention backend: %s (%s)", backend, reason)


def select_backend(q, k, cu_seqlens, window, backend="auto", key_mask=None):
    """Return ``(backend, reason)`` for these inputs; ``ValueError`` for unknown or impossible choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("reference", "chunked"):
        return backend, "requested"
    if backend == "fa4":
        why_not = "flash-attn-4 is not importable on an SM90+ GPU" if not fa4_available() else fa4_supports(q, window)
        why_not = why_not or (
            "a key_mask (padding holes) is taken by the chunked path" if key_mask is not None else None
        )
        if why_not:
            raise ValueError(f"backend='fa4' cannot run this case: {why_not}; use backend='auto'")
        return backend, "requested"
    if backend == "triton":
        why_not = triton_unsupported(q, k, cu_seqlens, key_mask, interpreter_ok=True)
        if why_not:
            raise ValueError(f"backend='triton' cannot run this case: {why_not}; use backend='auto'")
        return backend, "requested"
    if key_mask is None and q.is_cuda and fa4_available() and fa4_supports(q, window) is None:
        return "fa4", "auto: flash-attn-4 learnable_sink on SM90+"
    why_not_triton = triton_unsupported(q, k, cu_seqlens, key_mask)
    if why_not_triton is None:
        return "triton", "auto: CUDA tensors"
    return "chunked", f"auto: {why_not_triton}"


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


def _run_triton(q, k, v, sinks, cu_seqlens, info, max_seqlen, window, scale):
    """Validated inputs -> the Triton autograd function (no second validation, no device->host copy)."""
    try:
        from gptoss_kernels.triton.function import run_sink_attention_triton
    except ImportError as err:
        raise ValueError(f"backend 'triton' is not available ({err}); install triton or use backend='chunked'") from err
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if info is not None:
        return run_sink_attention_triton(q, k, v, sinks, cu_seqlens, max_seqlen or info.longest, window, scale)
    qp, kp, vp, cu_q, cu_k = _to_packed(q, k, v)
    out = run_sink_attention_triton(qp, kp, vp, sinks, cu_q, q.shape[1], window, scale, None, cu_k, k.shape[1])
    return out.view(q.shape)


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
        ``o`` shaped and typed like ``q``; differentiable in q, k, v and sinks.
    """
    info = check_sink_attention_inputs(
        q, k, v, sinks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window, key_mask=key_mask, scale=scale
    )
    chosen, reason = select_backend(q, k, cu_seqlens, window, backend, key_mask)
    _log_choice_once(chosen, reason)
    if chosen == "reference":
        return sink_attention_ref(
            q, k, v, sinks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window, scale=scale, key_mask=key_mask
        )
    if chosen == "chunked":
        scale = _check_tuning(DEFAULT_Q_CHUNK, None, scale, q.shape[-1])
        if backend == "auto" and fused_cpu_supports(q, k, cu_seqlens, window, key_mask) is None:
            # full causal layers: torch's fused CPU flash kernel + sink rescale, SDPA's memory (fused_cpu.py)
            return sink_attention_fused_cpu(q, k, v, sinks, scale=scale)
        layout = ("packed", info.bounds) if info is not None else ("batched", q.shape[1], k.shape[1])
        return _run_chunked(q, k, v, sinks, layout, cu_seqlens, window, scale, key_mask, DEFAULT_Q_CHUNK, None, False)
    if chosen == "fa4":
        longest = None if info is None else max_seqlen or info.longest
        return sink_attention_fa4(q, k, v, sinks, cu_seqlens=cu_seqlens, max_seqlen=longest, window=window, scale=scale)
    return _run_triton(q, k, v, sinks, cu_seqlens, info, max_seqlen, window, scale)
