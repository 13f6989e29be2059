"""The log-mass a top-k / top-p sampler keeps, per token, without ``[N, V]`` logits: scoring on the sampled support.

An engine that samples with ``top_k > 0`` or ``top_p < 1`` draws token ``y`` from the truncated distribution
``p_S(y) = p(y) / p(S)`` over its support ``S`` (``rollout/sampling.truncated``), and reports ``log p_S(y)``
(vLLM's ``processed_logprobs``). The trainer's head gives ``log p(y)`` over the whole vocabulary; scoring the
sampled policy needs ``log p_S(y) = log p(y) - log p(S)``. ``truncated_log_mass`` computes
``log p(S) = logsumexp_S(z) - logsumexp_V(z)`` for ``z = (h W^T + b) / T``, one ``[chunk, V]`` tile of rows at a
time, and recomputes each tile in backward. ``S`` is piecewise constant in ``z`` (no gradient through the
choice); ``d log p(S) / dz_v = p_S(v) [v in S] - p(v)``, so ``log p(y) - log p(S)`` has the gradient
``[v = y] - p_S(v) [v in S]`` of the truncated softmax. Computed in float32 (float64 for float64 inputs);
gradients return in each input's dtype. ``reference_truncated_log_mass`` is the plain PyTorch definition.
"""

from __future__ import annotations

import torch

from trl_gptoss.rollout.sampling import truncated

DEFAULT_CHUNK = 1024


def _tile(hidden, weight, bias, temperature):
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    z = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    return z / temperature


def reference_truncated_log_mass(hidden, weight, bias, temperature, top_k, top_p) -> torch.Tensor:
    """``log p(S)`` per row by definition (materialises ``[N, V]``; for tests)."""
    z = _tile(hidden, weight, bias, temperature)
    return torch.logsumexp(truncated(z, top_k, top_p), dim=-1) - torch.logsumexp(z, dim=-1)


class _TruncatedLogMass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, temperature, top_k, top_p, chunk):
        ctx.save_for_backward(hidden, weight, bias)
        ctx.settings = (temperature, top_k, top_p, chunk)
        out = []
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk):
                z = _tile(hidden[start : start + chunk], weight, bias, temperature)
                out.append(torch.logsumexp(truncated(z, top_k, top_p), dim=-1) - torch.logsumexp(z, dim=-1))
        return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias = ctx.saved_tensors
        temperature, top_k, top_p, chunk = ctx.settings
        grad_hidden = torch.zeros_like(hidden, dtype=grad.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=grad.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = None if bias is None or not ctx.needs_input_grad[2] else torch.zeros_like(bias, dtype=grad.dtype)
        for start in range(0, hidden.shape[0], chunk):
            rows = hidden[start : start + chunk]
            z = _tile(rows, weight, bias, temperature)
            kept = torch.softmax(truncated(z, top_k, top_p), dim=-1)
            grad_z = grad[start : start + chunk, None].to(z.dtype) * (kept - torch.softmax(z, dim=-1)) / temperature
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = (grad_z @ weight.to(z.dtype)).to(grad_hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad_z.T @ rows.to(z.dtype)).to(grad_weight.dtype)
            if grad_bias is not None:
                grad_bias += grad_z.sum(0).to(grad_bias.dtype)
        cast = [
            None if g is None else g.to(t.dtype)
            for g, t in ((grad_hidden, hidden), (grad_weight, weight), (grad_bias, bias))
        ]
        return (*cast, None, None, None, None)


def truncated_log_mass(hidden, weight, bias=None, *, temperature=1.0, top_k=-1, top_p=1.0, chunk=DEFAULT_CHUNK):
    """``hidden [N, H]``, ``weight [V, H]``, ``bias [V] | None`` -> ``log p(S) [N]`` (<= 0), float32 (float64
    for float64 inputs): the log of the probability mass the top-k / top-p support of each row keeps."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _TruncatedLogMass.apply(hidden, weight, bias, float(temperature), int(top_k), float(top_p), chunk)
