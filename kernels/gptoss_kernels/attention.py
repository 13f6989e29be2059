"""Public sink attention: validate once, pick a backend, log the choice once per backend.

``backend="auto"``: FA4 (``flash-attn-4`` on SM90+, when it supports the case) -> the package's Triton
kernel (CUDA, packed layout; batched ``Tq == Tk`` is flattened to it) -> the chunked PyTorch path
(CPU, and the CUDA fallback for decoding layouts ``Tq < Tk`` that the Triton kernel does not take).
Explicit ``"fa4" | "triton" | "chunked" | "reference"`` force one; a forced backend that cannot run the
case raises ``ValueError`` instead of silently falling back.
"""

from __future__ import annotations

import logging
import os

import torch

from gptoss_kernels.chunked import sink_attention_chunked
from gptoss_kernels.fa4 import fa4_available, fa4_supports, sink_attention_fa4
from gptoss_kernels.reference import sink_attention_ref
from gptoss_kernels.validation import check_sink_attention_inputs

logger = logging.getLogger("gptoss_kernels")

BACKENDS = ("auto", "fa4", "triton", "chunked", "reference")
_LOGGED: set[tuple[str, str]] = set()


def _log_choice_once(backend, reason):
    if (backend, reason) not in _LOGGED:
        _LOGGED.add((backend, reason))
        logger.info("sink_attention backend: %s (%s)", backend, reason)


def _triton_unsupported(q, k, cu_seqlens, interpreter_ok=False):
    """None when the Triton kernel can run this case, else why not (CPU only under TRITON_INTERPRET=1)."""
    if not q.is_cuda and not (interpreter_ok and os.environ.get("TRITON_INTERPRET") == "1"):
        return "tensors are not on CUDA (on CPU, backend='triton' needs TRITON_INTERPRET=1 set before import)"
    if cu_seqlens is None and q.shape[1] != k.shape[1]:
        return f"batched Tq={q.shape[1]} < Tk={k.shape[1]} (decoding) is not a packed layout"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton kernel takes fp16/bf16/fp32, not {q.dtype}"
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim > 128 or head_dim & (head_dim - 1):
        return f"the Triton kernel takes power-of-two head_dim in [16, 128], not {head_dim}"
    return None


def select_backend(q, k, cu_seqlens, window, backend="auto"):
    """Return ``(backend, reason)`` for these inputs; ``ValueError`` for unknown or impossible choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("reference", "chunked"):
        return backend, "requested"
    if backend == "fa4":
        why_not = "flash-attn-4 is not importable on an SM90+ GPU" if not fa4_available() else fa4_supports(q, window)
        if why_not:
            raise ValueError(f"backend='fa4' cannot run this case: {why_not}; use backend='auto'")
        return backend, "requested"
    if backend == "triton":
        why_not = _triton_unsupported(q, k, cu_seqlens, interpreter_ok=True)
        if why_not:
            raise ValueError(f"backend='triton' cannot run this case: {why_not}; use backend='auto'")
        return backend, "requested"
    if q.is_cuda and fa4_available() and fa4_supports(q, window) is None:
        return "fa4", "auto: flash-attn-4 learnable_sink on SM90+"
    why_not_triton = _triton_unsupported(q, k, cu_seqlens)
    if why_not_triton is None:
        return "triton", "auto: CUDA tensors"
    return "chunked", f"auto: {why_not_triton}"


def _to_packed(q, k, v):
    """Batched ``[B, T, H, D]`` with ``Tq == Tk`` -> packed ``[B*T, H, D]`` plus its int32 cu_seqlens."""
    batch, seqlen = q.shape[:2]
    cu_seqlens = (torch.arange(batch + 1, device=q.device) * seqlen).to(torch.int32)
    flat = [t.reshape(batch * seqlen, *t.shape[2:]) for t in (q, k, v)]
    return (*flat, cu_seqlens, seqlen)


def _run_triton(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale):
    try:
        from gptoss_kernels.triton import sink_attention_triton
    except ImportError as err:
        raise ValueError(f"backend 'triton' is not available ({err}); install triton or use backend='chunked'") from err
    if cu_seqlens is not None:
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
        return sink_attention_triton(q, k, v, sinks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                     window=window, scale=scale)
    qp, kp, vp, cu, seqlen = _to_packed(q, k, v)
    out = sink_attention_triton(qp, kp, vp, sinks, cu_seqlens=cu, max_seqlen=seqlen, window=window, scale=scale)
    return out.view(q.shape)


def sink_attention(q, k, v, sinks, *, cu_seqlens=None, max_seqlen=None, window=None, scale=None,
                   backend="auto"):
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
        backend: ``"auto" | "fa4" | "triton" | "chunked" | "reference"``.
    Returns:
        ``o`` shaped and typed like ``q``; differentiable in q, k, v and sinks.
    """
    check_sink_attention_inputs(q, k, v, sinks, cu_seqlens=cu_seqlens, window=window)
    chosen, reason = select_backend(q, k, cu_seqlens, window, backend)
    _log_choice_once(chosen, reason)
    kwargs = dict(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window, scale=scale)
    if chosen == "reference":
        return sink_attention_ref(q, k, v, sinks, **kwargs)
    if chosen == "chunked":
        return sink_attention_chunked(q, k, v, sinks, **kwargs)
    if chosen == "fa4":
        return sink_attention_fa4(q, k, v, sinks, **kwargs)
    return _run_triton(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale)
