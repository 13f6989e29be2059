"""``torch.autograd.Function`` and the public entry point of the Triton sink-attention kernels."""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from gptoss_kernels.autocast import autocast_inputs, without_autocast
from gptoss_kernels.triton.launchers import INTERPRETED, launch_config, sink_attention_bwd, sink_attention_fwd
from gptoss_kernels.validation import check_cross_lengths, check_sink_attention_inputs, triton_unsupported


class SinkAttentionTritonFunction(torch.autograd.Function):
    """Saves the inputs, ``o`` and the sink-inclusive ``lse``; the backward recomputes probabilities."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, block_sizes, cu_seqlens_k, max_seqlen_k):
        o, lse = sink_attention_fwd(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, block_sizes, cu_seqlens_k)
        ctx.save_for_backward(q, k, v, sinks, o, lse, cu_seqlens, cu_seqlens_k)
        ctx.launch_args = (max_seqlen, window, scale, block_sizes, max_seqlen_k)
        return o

    @staticmethod
    @once_differentiable  # the backward kernels are not differentiable themselves: fail loudly on double backward
    @without_autocast
    def backward(ctx, do):
        q, k, v, sinks, o, lse, cu_seqlens, cu_seqlens_k = ctx.saved_tensors
        max_seqlen, window, scale, block_sizes, max_seqlen_k = ctx.launch_args
        dq, dk, dv, dsinks = sink_attention_bwd(
            q,
            k,
            v,
            sinks,
            o,
            lse,
            do.contiguous(),
            cu_seqlens,
            max_seqlen,
            window,
            scale,
            block_sizes,
            cu_seqlens_k,
            max_seqlen_k,
        )
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None


def sink_attention_triton(
    q,
    k,
    v,
    sinks,
    *,
    cu_seqlens,
    max_seqlen,
    window=None,
    scale=None,
    block_sizes=None,
    cu_seqlens_k=None,
    max_seqlen_k=None,
):
    """Causal attention with one learnable sink logit per query head (Triton, FlashAttention-2 tiling).

    For query row i of head h in a document, at key position ``p_i`` (``p_i = i`` for self-attention;
    ``len_k - len_q + i`` when the document has more keys than queries: decoding with a KV cache, chunked
    prefill), with allowed keys j (``j <= p_i``; with ``window=W`` also ``j > p_i - W``, the last W tokens
    including self)::

        S_ij = scale * q_i . k_j
        lse_i = log(exp(sinks[h]) + sum_j exp(S_ij))        # the sink joins the denominator only
        o_i = sum_j exp(S_ij - lse_i) * v_j

    Args:
        q: ``[total, Hq, D]`` packed tokens of all documents; float16/bfloat16/float32 (fp32 accumulation).
        k, v: ``[total_k, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA); any ``1 <= D <= 128`` (tiles use the next
            power of two >= 16, padded with zeros inside the kernels; nothing is copied).
        sinks: ``[Hq]`` any float dtype; its gradient ``-sum_i exp(sinks[h] - lse_i) * rowsum(dO_i * o_i)``
            comes back in sinks' dtype.
        cu_seqlens: int32 ``[n_seqs + 1]`` document boundaries (empty documents allowed); documents never
            attend to each other.
        max_seqlen: int, at least the longest (query) document.
        cu_seqlens_k, max_seqlen_k: key documents when they are longer than the query ones (default: the
            same as the queries); document n has ``len_k[n] >= len_q[n]`` and its queries are its last keys.
        window: None (full causal) or a positive int.
        scale: score scale, default ``D ** -0.5``. The sink logit is not scaled.
        block_sizes: optional ``(BLOCK_M, BLOCK_N)`` powers of two >= 16 for every pass (tests, tuning);
            default picked per pass from the device (``launchers.launch_config``).

    Returns:
        ``o``: ``[total, Hq, D]`` in q's dtype (under ``torch.autocast`` q, k, v run in the autocast dtype,
        see ``gptoss_kernels.autocast``). Differentiable in q, k, v and sinks.
    """
    q, k, v = autocast_inputs(q, k, v)
    _check_triton_call(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, cu_seqlens_k, max_seqlen_k)
    if block_sizes is not None:
        launch_config(q.device.type, q.shape[-1], backward=False, block_sizes=block_sizes)  # validates them
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    return run_sink_attention_triton(
        q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, block_sizes, cu_seqlens_k, max_seqlen_k
    )


def _check_triton_call(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, cu_seqlens_k, max_seqlen_k):
    """The public contract plus the capability rule shared with ``sink_attention``'s dispatch."""
    if cu_seqlens is None:
        raise ValueError(
            "the Triton kernel takes the packed layout: pass cu_seqlens (int32 [n_seqs + 1]) "
            "and q/k/v shaped [total, H, D]"
        )
    for name, value in (("max_seqlen", max_seqlen), ("max_seqlen_k", max_seqlen_k)):
        if (value is not None or name == "max_seqlen") and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{name} must be an int >= the longest document, got {value!r}")
    if cu_seqlens_k is None:
        check_sink_attention_inputs(q, k, v, sinks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window)
    else:
        check_cross_lengths(q, k, v, sinks, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, window)
    why_not = triton_unsupported(q, k, cu_seqlens, interpreter_ok=INTERPRETED)
    if why_not:
        raise ValueError(f"the Triton kernel cannot run this case: {why_not}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float (default head_dim**-0.5), got {scale!r}")


def run_sink_attention_triton(
    q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, block_sizes=None, cu_seqlens_k=None, max_seqlen_k=None
):
    """Already validated inputs (``sink_attention`` checks once at its entry) -> the autograd function.

    Reads nothing back from the device: ``max_seqlen`` (int) sizes the grid, ``scale`` is a float.
    """
    if cu_seqlens_k is None:
        cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    if window is not None and window >= max_seqlen_k:
        window = None  # every causal key is inside the window: take the mask-free full-causal kernels
    q, k, v, cu_seqlens, cu_seqlens_k = (t.contiguous() for t in (q, k, v, cu_seqlens, cu_seqlens_k))
    return SinkAttentionTritonFunction.apply(
        q, k, v, sinks, cu_seqlens, max_seqlen, window, scale, block_sizes, cu_seqlens_k, max_seqlen_k
    )
