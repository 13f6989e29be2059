"""The sampling rule every engine and the trainer share: which distribution a token is drawn from.

vLLM with ``--logprobs-mode processed_logprobs`` returns ``log_softmax`` of the logits after temperature and
top-k/top-p masking (``vllm/v1/sample/ops/topk_topp_sampler.py``); ``processed_logprobs`` below is that
distribution, so an in-process engine's log-probs and the trainer's recomputation mean the same thing.
"""

from __future__ import annotations

import torch


def processed_logprobs(logits: torch.Tensor, temperature, top_k=None, top_p=None) -> torch.Tensor:
    """Log-probs of the distribution actually sampled from, per row.

    ``logits: [B, V]`` (any float dtype; computed in float32, or float64 when given float64).
    ``temperature, top_k, top_p``: scalars or ``[B]`` tensors. ``top_k <= 0`` and ``top_p == 1`` disable
    their filter. Math: ``z = logits / T``; top-k keeps ``z >= z_(k)`` (ties kept, as vLLM);
    top-p keeps the most probable tokens whose mass reaches ``p`` (at least one); returns
    ``log_softmax(z masked with -inf)``: ``[B, V]``.
    """
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(compute_dtype)
    batch = z.shape[0]
    temperature = torch.as_tensor(temperature, dtype=compute_dtype, device=z.device).expand(batch)
    return torch.log_softmax(truncated(z / temperature[:, None], top_k, top_p), dim=-1)


def truncated(z: torch.Tensor, top_k=None, top_p=None) -> torch.Tensor:
    """Tempered logits ``z [B, V]`` with every token outside the top-k / top-p support set to ``-inf`` (the
    rule above; ``top_k <= 0``, ``top_p == 1`` or ``None`` disable a filter)."""
    batch = z.shape[0]
    if top_k is not None:
        z = _mask_top_k(z, torch.as_tensor(top_k, device=z.device).expand(batch))
    if top_p is not None:
        z = _mask_top_p(z, torch.as_tensor(top_p, dtype=z.dtype, device=z.device).expand(batch))
    return z


def _mask_top_k(z: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    active = (k > 0) & (k < z.shape[-1])
    if not bool(active.any()):
        return z
    k = torch.where(active, k, torch.ones_like(k)).long()
    kth = z.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # [B, 1]: k-th largest value
    return torch.where(active[:, None] & (z < kth), torch.full_like(z, float("-inf")), z)


def _mask_top_p(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    active = p < 1
    if not bool(active.any()):
        return z
    sorted_z, order = z.sort(dim=-1, descending=False)
    mass_below = sorted_z.softmax(dim=-1).cumsum(dim=-1)  # ascending: mass of this token and all less likely
    drop = mass_below <= (1 - p)[:, None]
    drop[:, -1] = False  # the most probable token always survives
    drop &= active[:, None]
    mask = torch.zeros_like(drop).scatter(1, order, drop)
    return z.masked_fill(mask, float("-inf"))


def sample_from_logprobs(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row ``b`` takes the first token whose cumulative probability reaches ``u_b``.

    ``logprobs: [B, V]``, ``uniforms: [B]`` in ``(0, 1]`` (never 0, so a zero-probability token at the
    start of the vocabulary can never be chosen). One uniform per row per step keeps each row's draws a
    function of its own seed only, whatever else is in the batch. Returns ``[B]`` int64 token ids.
    """
    cdf = logprobs.exp().cumsum(dim=-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=logprobs.shape[-1] - 1)
