"""Per-token log-probabilities (and entropies) of sampled tokens through ``lm_head``, without ``[N, V]`` logits.

For token n with last hidden state ``h_n``, sampled id ``y_n`` and temperature ``T``::

    z_n   = (h_n @ W.T + b) / T                      # [V], fp32 (float64 for float64 inputs)
    lse_n = log sum_v exp(z_nv)
    logp_n = z_n[y_n] - lse_n
    H_n   = lse_n - sum_v p_nv z_nv,   p_nv = exp(z_nv - lse_n)

Forward walks the tokens in chunks of ``chunk_size`` rows: one ``[chunk, V]`` logits tile at a time, reduced
to ``lse``, the target logit and (optionally) the entropy. Only ``hidden, weight, bias, token_ids, lse`` (and
``H`` when entropies are returned) are saved. Backward recomputes each tile and forms the logits gradient::

    dz_nv = g_n (1[v = y_n] - p_nv) - gH_n p_nv (log p_nv + H_n),   dlogits = dz / T
    grad_hidden[chunk] = dlogits @ W,   grad_W += dlogits.T @ hidden[chunk],   grad_b += sum_n dlogits

with ``grad_W`` / ``grad_b`` accumulated in fp32. Low-precision inputs are upcast (hidden per chunk, weight once
per pass: a transient ``V x H`` fp32 copy) so every logit is accumulated and kept in fp32.

Layers: ``_chunk_*`` (one tile) -> ``_forward`` / ``_backward`` (loop the tiles, own the buffers) ->
``SelectiveLogprobsFunction`` -> ``selective_logprobs``. ``selective_logprobs_ref`` materialises the logits.
"""

from __future__ import annotations

import math
import numbers

import torch

# Bytes of one fp32 logits tile; forward holds two tiles (logits, exp), backward two (log p, p).
DEFAULT_TILE_BYTES = 256 * 2**20
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def default_chunk_size(vocab: int) -> int:
    """Token rows per tile so one fp32 ``[chunk, vocab]`` tile stays within ``DEFAULT_TILE_BYTES``.

    Rounded down to a multiple of 64 rows when that many fit (GEMM-friendly; 320 rows at V = 201,088).
    """
    rows = max(1, DEFAULT_TILE_BYTES // (4 * max(vocab, 1)))
    return rows - rows % 64 if rows >= 64 else rows


def _compute_dtype(*tensors) -> torch.dtype:
    """fp32 accumulation for fp16/bf16/fp32 inputs; float64 when any input is float64."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def _check_tensor(name, t, ndims, device=None):
    if not isinstance(t, torch.Tensor) or t.dim() not in ndims:
        want = " or ".join(f"{d}-D" for d in ndims)
        raise ValueError(f"{name} must be a {want} tensor, got {type(t).__name__} of shape {getattr(t, 'shape', None)}")
    if _is_dtensor(t):
        raise ValueError(f"{name} is a DTensor; gather it first ({name}.full_tensor()) and pass the plain tensor")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but hidden is on {device}; all inputs must share a device")


def check_selective_logprobs_inputs(hidden, weight, token_ids, bias, temperature, chunk_size) -> None:
    """Raise ``ValueError`` naming the argument for any bad input; reads ``token_ids``' min/max (one sync)."""
    _check_tensor("hidden", hidden, (2, 3))
    _check_tensor("weight", weight, (2,), hidden.device)
    _check_tensor("token_ids", token_ids, (hidden.dim() - 1,), hidden.device)
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; expected one of float16/bfloat16/float32/float64")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got shape {tuple(weight.shape)}"
        )
    if token_ids.shape != hidden.shape[:-1]:
        raise ValueError(
            f"token_ids must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, got {tuple(token_ids.shape)}"
        )
    if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}; use token_ids.long()")
    if bias is not None:
        _check_tensor("bias", bias, (1,), hidden.device)
        if bias.shape[0] != weight.shape[0] or bias.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"bias must be a float [V={weight.shape[0]}] tensor, got {bias.dtype} {tuple(bias.shape)}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size <= 0
    ):
        raise ValueError(f"chunk_size must be a positive int (token rows per tile) or None, got {chunk_size!r}")
    if token_ids.numel():
        low, high = int(token_ids.min()), int(token_ids.max())
        if low < 0 or high >= weight.shape[0]:
            raise ValueError(f"token_ids must lie in [0, V={weight.shape[0]}), got values in [{low}, {high}]")


def _chunk_logits(out, h, w, b, temperature):
    """``out[:n] = (h @ w.T + b) / T`` in place; ``h``, ``w``, ``b`` already in the compute dtype."""
    if b is None:
        torch.mm(h, w.t(), out=out)
    else:
        torch.addmm(b, h, w.t(), out=out)
    if temperature != 1.0:
        out.div_(temperature)
    return out


def _chunk_forward(z, e, ids, want_entropy):
    """Reduce one logits tile ``z: [n, V]`` to ``(logp, lse, H)`` (``H`` None unless asked); ``z`` is clobbered."""
    target = z.gather(1, ids.unsqueeze(1)).squeeze(1)
    shift = z.amax(dim=1)
    z.sub_(shift.unsqueeze(1))  # z - max: exp cannot overflow
    torch.exp(z, out=e)
    sum_exp = e.sum(dim=1)
    log_sum = torch.log(sum_exp)
    lse = shift + log_sum
    entropy = None
    if want_entropy:  # H = log S - sum_v e_v (z_v - max) / S ; the row dot products avoid another [n, V] buffer
        weighted = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1)
        entropy = log_sum - weighted / sum_exp
    return target - lse, lse, entropy


def _chunk_grad_logits(z, p, ids, lse, g_logp, g_entropy, entropy):
    """Turn the recomputed tile ``z: [n, V]`` into ``dlogits`` in place (``g_*`` already divided by T)."""
    z.sub_(lse.unsqueeze(1))  # log p
    torch.exp(z, out=p)
    if g_entropy is None:
        z.copy_(p).mul_(-g_logp.unsqueeze(1))
    else:  # -gH p (log p + H)
        z.add_(entropy.unsqueeze(1)).mul_(p).mul_(-g_entropy.unsqueeze(1))
        if g_logp is not None:
            z.sub_(p.mul_(g_logp.unsqueeze(1)))
    if g_logp is not None:
        z.scatter_add_(1, ids.unsqueeze(1), g_logp.unsqueeze(1))
    return z


def _forward(hidden, weight, bias, token_ids, temperature, chunk_size, want_entropy):
    """Loop the tiles: returns ``(logp, lse, H | None)``, each ``[N]`` in the compute dtype."""
    dtype = _compute_dtype(hidden, weight, bias)
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    logp = torch.empty(n_tokens, device=hidden.device, dtype=dtype)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if want_entropy else None
    w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
    rows = min(chunk_size, n_tokens)
    z_buf = torch.empty(rows, vocab, device=hidden.device, dtype=dtype)
    e_buf = torch.empty_like(z_buf)
    for start in range(0, n_tokens, chunk_size):
        stop = min(start + chunk_size, n_tokens)
        z = _chunk_logits(z_buf[: stop - start], hidden[start:stop].to(dtype), w, b, temperature)
        out = _chunk_forward(z, e_buf[: stop - start], token_ids[start:stop], want_entropy)
        logp[start:stop], lse[start:stop] = out[0], out[1]
        if want_entropy:
            entropy[start:stop] = out[2]
    return logp, lse, entropy


def _backward(hidden, weight, bias, token_ids, lse, entropy, g_logp, g_entropy, temperature, chunk_size, needs):
    """Loop the tiles again: ``(grad_hidden, grad_weight, grad_bias)`` in the inputs' dtypes (None where unneeded)."""
    dtype = lse.dtype
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
    g_logp = None if g_logp is None else g_logp.to(dtype) / temperature
    g_entropy = None if g_entropy is None else g_entropy.to(dtype) / temperature
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    grad_h = torch.empty(hidden.shape, device=hidden.device, dtype=hidden.dtype) if needs[0] else None
    grad_w = torch.zeros(weight.shape, device=weight.device, dtype=acc) if needs[1] else None
    grad_b = torch.zeros(vocab, device=weight.device, dtype=acc) if needs[2] else None
    rows = min(chunk_size, n_tokens)
    z_buf = torch.empty(rows, vocab, device=hidden.device, dtype=dtype)
    p_buf = torch.empty_like(z_buf)
    for start in range(0, n_tokens, chunk_size):
        stop = min(start + chunk_size, n_tokens)
        sl = slice(start, stop)
        h = hidden[sl].to(dtype)
        z = _chunk_logits(z_buf[: stop - start], h, w, b, temperature)
        dz = _chunk_grad_logits(
            z,
            p_buf[: stop - start],
            token_ids[sl],
            lse[sl],
            None if g_logp is None else g_logp[sl],
            None if g_entropy is None else g_entropy[sl],
            None if entropy is None else entropy[sl],
        )
        if grad_h is not None:
            grad_h[sl] = dz @ w
        if grad_w is not None:
            grad_w.addmm_(dz.t(), h)
        if grad_b is not None:
            grad_b += dz.sum(dim=0)
    return (
        grad_h,
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None else grad_b.to(bias.dtype),
    )


class SelectiveLogprobsFunction(torch.autograd.Function):
    """Autograd wrapper of ``_forward`` / ``_backward``; saves inputs, ``lse`` and (if returned) ``H`` only."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, token_ids, temperature, chunk_size, want_entropy):
        ctx.set_materialize_grads(False)  # an unused entropy output costs nothing in backward
        with torch.autocast(hidden.device.type, enabled=False):
            logp, lse, entropy = _forward(hidden, weight, bias, token_ids, temperature, chunk_size, want_entropy)
        ctx.save_for_backward(hidden, weight, bias, token_ids, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if entropy is None:
            return logp
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy=None):
        hidden, weight, bias, token_ids, lse, entropy = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        if (g_logp is None and g_entropy is None) or not any(needs):
            return None, None, None, None, None, None, None
        with torch.autocast(hidden.device.type, enabled=False):
            grads = _backward(
                hidden, weight, bias, token_ids, lse, entropy, g_logp, g_entropy, ctx.temperature, ctx.chunk_size, needs
            )
        return (*grads, None, None, None, None)


def selective_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
):
    """Log-probabilities of ``token_ids`` under ``softmax((hidden @ weight.T + bias) / temperature)``, chunked.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` last hidden states (any float dtype).
        weight: ``[V, H]`` lm_head weight (a plain tensor; gather a DTensor with ``full_tensor()`` first).
        token_ids: ``[N]`` or ``[B, T]`` integer ids in ``[0, V)``.
        bias: optional ``[V]`` lm_head bias.
        temperature: positive finite ``T``; logits are divided by it.
        return_entropy: also return ``H = -sum_v p_v log p_v`` of the tempered distribution.
        chunk_size: token rows per ``[chunk, V]`` fp32 tile; default ``default_chunk_size(V)`` (~256 MiB tile).

    Returns:
        ``logp`` shaped like ``token_ids`` (float32; float64 when an input is float64), or ``(logp, entropy)``.
        Both are differentiable in ``hidden``, ``weight`` and ``bias`` (the entropy gradient is what an entropy
        bonus needs); the ``[N, V]`` logits are never held, and backward recomputes them tile by tile.

    Raises:
        ValueError: naming the argument, for bad shapes, dtypes, ids outside ``[0, V)``, ``temperature`` or
        ``chunk_size``; raised before any computation.
    """
    check_selective_logprobs_inputs(hidden, weight, token_ids, bias, temperature, chunk_size)
    chunk = int(chunk_size) if chunk_size is not None else default_chunk_size(weight.shape[0])
    lead = token_ids.shape
    out = SelectiveLogprobsFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        token_ids.reshape(-1).long(),
        float(temperature),
        chunk,
        bool(return_entropy),
    )
    if return_entropy:
        return out[0].view(lead), out[1].view(lead)
    return out.view(lead)


def selective_logprobs_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
):
    """Reference of ``selective_logprobs``: materialises ``[N, V]`` logits; same contract, autograd gradients.

    ``chunk_size`` is validated and ignored. Compute dtype: float64 when an input is float64, else float32.
    """
    check_selective_logprobs_inputs(hidden, weight, token_ids, bias, temperature, chunk_size)
    dtype = _compute_dtype(hidden, weight, bias)
    logits = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        logits = logits + bias.to(dtype)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logp
    return logp, -(logp_all.exp() * logp_all).sum(-1)
