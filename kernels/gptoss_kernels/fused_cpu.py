"""Full causal sink attention on CPU through torch's fused flash kernel (the memory of torch SDPA).

The sink enters only through the log-sum-exp. With torch's plain causal attention ``o, lse`` (no sink)::

    lse' = logaddexp(lse, s_h)                 # sink-inclusive log-sum-exp
    o'   = o * exp(lse - lse') = o * sigmoid(lse - s_h)

and, because ``P' = exp(S - lse')`` is exactly the sink-inclusive softmax, torch's flash backward called
with ``(o', lse')`` returns the exact ``dq, dk, dv`` (its ``D_i = rowsum(dO_i * o'_i)`` is the sink-aware
one). The sink gradient is ``dsinks[h] = -sum_i exp(s_h - lse'_i) * D_i`` (``= -sum_i P_sink,i sum_j P_ij
dP_ij``). Nothing larger than q is allocated beyond what torch's kernel itself needs; GQA is native (K/V
are never repeated). Used by ``sink_attention`` for batched ``Tq == Tk`` full-causal float32/float64 CPU
calls (GPT-OSS's full-attention layers); windows, padding and packing take the chunked path.
"""

from __future__ import annotations

import torch

from gptoss_kernels.autocast import autocast_inputs, without_autocast

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_ROWS_PER_DELTA_CHUNK = 32  # [B, Hq, 32, D] product temps: 0.5 MiB at GPT-OSS heads


def fused_cpu_supports(q, k, cu_seqlens, window, key_mask) -> str | None:
    """None when the fused CPU path computes this case exactly, else why not."""
    if q.device.type != "cpu":
        return "not a CPU tensor"
    if cu_seqlens is not None or key_mask is not None:
        return "packed documents / padding masks take the chunked path"
    if q.shape[1] != k.shape[1] or q.shape[1] == 0:
        return "Tq < Tk (or no token) takes the chunked path"
    if window is not None and window < k.shape[1]:
        return "a sliding window takes the chunked path (band-limited tiles)"
    if q.dtype not in (torch.float32, torch.float64):
        return f"{q.dtype}: the sink rescale would round o twice in 16 bits"
    return None


def _row_dots(a, b):
    """``rowsum(a * b)`` over the last dim of two ``[B, H, T, D]`` tensors, ``[B, H, T]``, in row chunks (no
    second ``[B, H, T, D]`` product tensor)."""
    out = a.new_empty(a.shape[:-1])
    for t0 in range(0, a.shape[2], _ROWS_PER_DELTA_CHUNK):
        t1 = min(t0 + _ROWS_PER_DELTA_CHUNK, a.shape[2])
        torch.sum(a[:, :, t0:t1] * b[:, :, t0:t1], dim=-1, out=out[:, :, t0:t1])
    return out


class FusedCpuSinkAttention(torch.autograd.Function):
    """q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]``, sinks ``[Hq]`` -> o ``[B, T, Hq, D]`` (a transposed view)."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, sinks, scale):
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        out, lse = _FLASH_CPU(qh, kh, vh, 0.0, True, scale=scale)
        sink = sinks.detach().to(lse.dtype)[None, :, None]
        out.mul_(torch.sigmoid(lse - sink).unsqueeze(-1).to(out.dtype))
        lse = torch.logaddexp(lse, sink)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.scale = scale
        return out.transpose(1, 2)

    @staticmethod
    @without_autocast
    def backward(ctx, grad_out):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        do = grad_out.transpose(1, 2)
        dq, dk, dv = _FLASH_CPU_BACKWARD(
            do, *(t.transpose(1, 2) for t in (q, k, v)), out, lse, 0.0, True, scale=ctx.scale
        )
        dsinks = None
        if ctx.needs_input_grad[3]:
            delta = _row_dots(do, out).to(lse.dtype)  # D_i = dO_i . o'_i   [B, Hq, T]
            sink_prob = torch.exp(sinks.detach().to(lse.dtype)[None, :, None] - lse)
            dsinks = -(sink_prob * delta).sum(dim=(0, 2)).to(sinks.dtype)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), dsinks, None


def sink_attention_fused_cpu(q, k, v, sinks, *, scale=None):
    """Full causal sink attention, batched ``q: [B, T, Hq, D]``, ``k, v: [B, T, Hkv, D]`` on CPU
    (validated by the caller; see ``fused_cpu_supports``). Differentiable in q, k, v and sinks."""
    q, k, v = autocast_inputs(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return FusedCpuSinkAttention.apply(q, k, v, sinks, scale)
