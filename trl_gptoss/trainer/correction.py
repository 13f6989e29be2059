"""Rollout correction between the engine that sampled a completion and the trainer that scores it.

Notation, per completion token t of row b (loss tokens only: sampled, not tool output, not padding):

    log r[b, t] = log pi_train(y_t) - log pi_rollout(y_t)      (trainer's log-prob at rollout time minus engine's)

``pi_train`` is the trainer's policy *before* this update (the "old" policy; on-policy it is the current policy,
detached). Presets follow verl's ``algorithm.rollout_correction`` ("decoupled" mode, three policies) and are
applied as detached weights that multiply the per-token policy loss, after the PPO clip:

| preset              | weight w[b, t]                                              | verl preset                   |
|---------------------|-------------------------------------------------------------|-------------------------------|
| ``none``            | 1                                                           | ``disabled``                  |
| ``token_tis``       | clamp(r[b, t], lower, upper)           (truncated IS)       | ``decoupled_token_is``        |
| ``token_mis``       | r[b, t] if lower <= r[b, t] <= upper else 0  (masked IS)    | token-level ``rollout_rs``    |
| ``seq_tis``         | clamp(R[b], lower, upper), R[b] = exp(sum_t log r[b, t])    | ``decoupled_seq_is``          |
| ``seq_mis``         | R[b] if lower <= R[b] <= upper else 0                       | ``decoupled_seq_is_rs``       |
| ``geo_rs``          | 1 if rs_lower <= G[b] <= rs_upper else 0, G[b] = exp(mean_t log r) | ``decoupled_geo_rs`` |
| ``geo_rs_token_tis``| geo_rs rejection x token_tis weight                         | ``decoupled_geo_rs_token_tis``|

Log-ratios are clamped to [-20, 20] before ``exp`` (verl's guard) and tokens whose engine log-prob is NaN get
log r = 0 (no evidence, no correction). Truncation with ``lower=None`` clamps from above only.

The mismatch metrics (``rollout_corr/...``) are computed from the same log r, whatever the preset, so the
train-inference gap is always visible: k1 = E[-log r] and k3 = E[r - 1 - log r] estimate
KL(pi_rollout || pi_train) from the engine's samples; max/mean |log r|; per-sequence perplexities; the
fractions of tokens/sequences the preset clipped or masked; and the effective sample size of the weights,
ESS = (E[w])^2 / E[w^2] in (0, 1] (1 when all weights are equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

LOG_RATIO_CLAMP = 20.0

ISLevel = Literal["token", "sequence"]
ISMode = Literal["truncate", "mask"]


@dataclass(frozen=True)
class CorrectionPreset:
    """What a preset does: an importance-sampling weight (level and mode) and/or geometric-mean rejection."""

    is_level: ISLevel | None
    is_mode: ISMode | None
    geometric_rejection: bool

    @property
    def applies_weights(self) -> bool:
        """Whether the preset changes the loss at all (``none`` only logs the mismatch metrics)."""
        return self.is_level is not None or self.geometric_rejection


PRESETS: dict[str, CorrectionPreset] = {
    "none": CorrectionPreset(None, None, False),
    "token_tis": CorrectionPreset("token", "truncate", False),
    "token_mis": CorrectionPreset("token", "mask", False),
    "seq_tis": CorrectionPreset("sequence", "truncate", False),
    "seq_mis": CorrectionPreset("sequence", "mask", False),
    "geo_rs": CorrectionPreset(None, None, True),
    "geo_rs_token_tis": CorrectionPreset("token", "truncate", True),
}


# TRL's ``vllm_importance_sampling_mode`` -> (IS level, IS mode): the one list of the IS mode names.
TRL_IS_MODES: dict[str, tuple[ISLevel, ISMode]] = {
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence", "truncate"),
    "sequence_mask": ("sequence", "mask"),
}


def preset_from_trl(is_mode: str | None, geometric_rejection: bool) -> CorrectionPreset:
    """The preset meant by TRL's ``vllm_importance_sampling_mode`` (None: no IS weights) plus geometric rejection."""
    if is_mode is None:
        return CorrectionPreset(None, None, geometric_rejection)
    if is_mode not in TRL_IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={is_mode!r}; choose one of {sorted(TRL_IS_MODES)}")
    level, mode = TRL_IS_MODES[is_mode]
    return CorrectionPreset(level, mode, geometric_rejection)


def trl_fields_of(preset_name: str) -> tuple[str | None, bool]:
    """``(vllm_importance_sampling_mode or None, rollout_geometric_rejection)`` meaning the preset ``preset_name``:
    how a deprecated ``rollout_correction`` name maps onto TRL's fields."""
    preset = PRESETS[preset_name]
    weights = (preset.is_level, preset.is_mode)
    mode = next((name for name, level_mode in TRL_IS_MODES.items() if level_mode == weights), None)
    return mode, preset.geometric_rejection


@dataclass(frozen=True)
class CorrectionThresholds:
    """Bounds on the IS ratio (``is_upper`` None: no upper bound; ``is_lower`` None: no lower clamp for
    truncation, ``1/is_upper`` for masking) and on the geometric-mean ratio G for rejection."""

    is_upper: float | None = 2.0
    is_lower: float | None = None
    rs_upper: float = 1.001
    rs_lower: float = 0.999

    def __post_init__(self):
        upper = math.inf if self.is_upper is None else self.is_upper
        if not upper > 0:
            raise ValueError(f"vllm_importance_sampling_clip_max must be > 0 or null, got {self.is_upper}")
        if self.is_lower is not None and not 0 <= self.is_lower <= upper:
            raise ValueError(
                f"vllm_importance_sampling_clip_min must lie in [0, clip_max={self.is_upper}], got {self.is_lower}"
            )
        if not 0 < self.rs_lower <= 1 <= self.rs_upper:
            raise ValueError(
                "geometric rejection thresholds must satisfy 0 < rollout_rs_threshold_lower <= 1 <= "
                f"rollout_rs_threshold, got rollout_rs_threshold_lower={self.rs_lower}, "
                f"rollout_rs_threshold={self.rs_upper}"
            )


@dataclass
class Correction:
    """Result of ``rollout_correction``: ``weights [B, T]`` (detached, 0 outside the loss mask) and the
    per-token / per-sequence booleans the metrics count."""

    weights: torch.Tensor
    clipped: torch.Tensor  # [B, T] bool: tokens whose IS weight was truncated
    masked: torch.Tensor  # [B, T] bool: tokens zeroed by IS masking or rejection
    rejected_seqs: torch.Tensor  # [B] bool: sequences dropped by geometric rejection


def masked_log_ratio(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log r = (train - rollout) on loss tokens, 0 elsewhere and where the engine gave NaN; clamped to +-20.

    train_logps, rollout_logps, mask: ``[B, T]``. Returns float ``[B, T]``, detached.
    """
    diff = (train_logps.detach().float() - rollout_logps.float()) * mask
    diff = torch.nan_to_num(diff, nan=0.0)
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask


def _apply_is(ratio: torch.Tensor, mode: ISMode, th: CorrectionThresholds):
    """Truncate or mask ratios (any shape). Returns ``(weight, clipped, masked)``."""
    if mode == "truncate":
        weight = ratio.clamp(min=th.is_lower, max=th.is_upper)
        return weight, weight != ratio, torch.zeros_like(ratio, dtype=torch.bool)
    upper = math.inf if th.is_upper is None else th.is_upper
    lower = th.is_lower if th.is_lower is not None else 1.0 / upper
    outside = (ratio < lower) | (ratio > upper)
    return ratio.masked_fill(outside, 0.0), torch.zeros_like(outside), outside


def rollout_correction(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    preset: str | CorrectionPreset,
    thresholds: CorrectionThresholds = CorrectionThresholds(),
) -> Correction:
    """Correction weights for one batch. ``log_ratio, mask: [B, T]`` (``log_ratio`` from ``masked_log_ratio``)."""
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    mask_b = mask.bool()
    weights = torch.ones_like(log_ratio)
    clipped = torch.zeros_like(mask_b)
    masked = torch.zeros_like(mask_b)
    if preset.is_level == "token":
        weights, clipped, masked = _apply_is(log_ratio.exp(), preset.is_mode, thresholds)
    elif preset.is_level == "sequence":
        seq_ratio = log_ratio.sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        seq_weight, seq_clipped, seq_masked = _apply_is(seq_ratio, preset.is_mode, thresholds)
        weights, clipped, masked = seq_weight.expand_as(log_ratio), seq_clipped & mask_b, seq_masked & mask_b
    rejected = torch.zeros(log_ratio.shape[0], dtype=torch.bool, device=log_ratio.device)
    if preset.geometric_rejection:
        geo = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)).exp()
        rejected = ((geo < thresholds.rs_lower) | (geo > thresholds.rs_upper)) & mask_b.any(-1)
        weights = weights.masked_fill(rejected[:, None], 0.0)
        masked = masked | (rejected[:, None] & mask_b)
    return Correction((weights * mask).detach(), clipped & mask_b, masked & mask_b, rejected)


# Order of the summed statistics; ``finalize_metrics`` turns (sums, maxes) reduced over processes into metrics.
SUM_KEYS = (
    "tokens",
    "seqs",
    "k1",
    "k3",
    "abs_diff",
    "clipped",
    "masked",
    "rejected",
    "w",
    "w2",
    "train_nll_seq_mean",
    "rollout_nll_seq_mean",
    "train_ppl",
    "rollout_ppl",
)
MAX_KEYS = ("max_abs_diff", "max_log_ratio", "neg_min_log_ratio")


def mismatch_stats(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    correction: Correction,
    log_ratio: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive and max statistics of one micro-batch, as float64 vectors ordered like SUM_KEYS / MAX_KEYS.

    Summing ``sums`` and taking the max of ``maxes`` over micro-batches or processes, then calling
    ``finalize_metrics``, gives the metrics of the union (exact, not a mean of means).
    """
    mask_f = mask.to(torch.float64)
    lr = log_ratio.to(torch.float64)
    tokens = mask_f.sum()
    rows = mask_f.sum(-1)
    has_tokens = rows > 0
    safe_rows = rows.clamp(min=1)
    train_nll = -(torch.nan_to_num(train_logps.detach().double()) * mask_f).sum(-1) / safe_rows
    rollout_nll = -(torch.nan_to_num(rollout_logps.double()) * mask_f).sum(-1) / safe_rows
    weight_units = correction.weights.double() * mask_f  # token-level weights over loss tokens
    abs_lr = lr.abs() * mask_f
    sums = torch.stack(
        [
            tokens,
            has_tokens.double().sum(),
            (-lr * mask_f).sum(),
            ((lr.exp() - 1 - lr) * mask_f).sum(),
            abs_lr.sum(),
            correction.clipped.double().sum(),
            correction.masked.double().sum(),
            correction.rejected_seqs.double().sum(),
            weight_units.sum(),
            (weight_units**2).sum(),
            train_nll[has_tokens].sum(),
            rollout_nll[has_tokens].sum(),
            train_nll[has_tokens].exp().sum(),
            rollout_nll[has_tokens].exp().sum(),
        ]
    )
    neg_inf = torch.tensor(-math.inf, dtype=torch.float64, device=lr.device)
    on = mask.bool()
    maxes = torch.stack(
        [
            abs_lr.max() if tokens > 0 else neg_inf,
            lr[on].max() if tokens > 0 else neg_inf,
            (-lr[on]).max() if tokens > 0 else neg_inf,
        ]
    )
    return sums, maxes


def finalize_metrics(sums: torch.Tensor, maxes: torch.Tensor) -> dict[str, float]:
    """Metric name (without the ``rollout_corr/`` prefix) -> value, from reduced ``mismatch_stats``."""
    s = dict(zip(SUM_KEYS, sums.tolist()))
    m = dict(zip(MAX_KEYS, [0.0 if v == -math.inf else v for v in maxes.tolist()]))
    tokens, seqs = max(s["tokens"], 1.0), max(s["seqs"], 1.0)
    mean_w, mean_w2 = s["w"] / tokens, s["w2"] / tokens
    return {
        "kl_k1": s["k1"] / tokens,
        "kl_k3": s["k3"] / tokens,
        "abs_logp_diff_mean": s["abs_diff"] / tokens,
        "abs_logp_diff_max": m["max_abs_diff"],
        "log_ratio_max": m["max_log_ratio"],
        "log_ratio_min": -m["neg_min_log_ratio"],
        "training_ppl": s["train_ppl"] / seqs,
        "rollout_ppl": s["rollout_ppl"] / seqs,
        "log_ppl_diff": (s["train_nll_seq_mean"] - s["rollout_nll_seq_mean"]) / seqs,
        "is_clip_fraction": s["clipped"] / tokens,
        "is_mask_fraction": s["masked"] / tokens,
        "rs_seq_rejected_fraction": s["rejected"] / seqs,
        "is_weight_mean": mean_w,
        "ess": (mean_w**2 / mean_w2) if mean_w2 > 0 else 0.0,
    }
