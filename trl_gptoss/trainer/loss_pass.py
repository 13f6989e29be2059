"""The one piece of state the loss hooks share: created by ``_compute_loss``, read by the log-prob hook.

TRL's ``_compute_loss`` calls ``_get_per_token_logps_and_entropies`` for the policy's log-probs; the trainer
needs, inside that call, the micro-batch's inputs (to apply rollout correction to its advantages), the
log-probs the SP runner already computed (if any), a scope that keeps R3 replay hooks alive until the backward
pass has re-run the routers (gradient checkpointing), and the collectives its metrics reduce over: the
accelerator's, or -- for one SP micro-batch, whose loss only its owner rank computes while its peers are inside
the runner's collectives -- this process's alone. ``LossPass`` carries exactly that.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from trl_gptoss.trainer.correction import finalize_metrics, masked_log_ratio, mismatch_stats, rollout_correction


class LocalCollectives:
    """An accelerator whose metric collectives (gather, reduce) act on this process only."""

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @staticmethod
    def gather(tensor):
        return tensor if tensor.dim() else tensor[None]

    gather_for_metrics = gather

    @staticmethod
    def reduce(tensor, reduction="sum", scale=1.0):
        return tensor * scale


@dataclass
class LossPass:
    """One micro-batch's loss computation.

    ``inputs``: a shallow copy of TRL's batch dict (the correction replaces its ``"advantages"``; TRL reuses the
    buffered original for every iteration). ``collectives``: what its metrics gather and reduce over (an
    accelerator, or ``LocalCollectives``; ``local`` says which). ``logps``, ``entropies``: ``[B, T]`` completion
    log-probs and entropies computed elsewhere (SP), or None. ``scope``: contexts that must outlive the forward
    (closed after backward, or at once in eval).
    """

    inputs: dict
    collectives: object
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    scope: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    logps_taken: bool = False

    @property
    def local(self) -> bool:
        return isinstance(self.collectives, LocalCollectives)

    def take_policy_call(self) -> bool:
        """True for the first log-prob call of this pass (the policy's); later calls are not the loss's."""
        first = not self.logps_taken
        self.logps_taken = True
        return first

    def correct(self, logps: torch.Tensor, args) -> dict[str, float]:
        """Scale the advantages by the rollout-correction weights; return the mismatch metrics.

        Every TRL loss multiplies the advantage into each token's term after the clip (``-min(c1 A, c2 A)``,
        ``-c A logp``, ...), so with weights ``w >= 0``, ``A * w`` gives exactly ``w * per_token_loss`` --
        verl's placement of the correction -- without reimplementing the loss. ``logps: [B, T]``: the policy's.
        """
        inputs, collectives = self.inputs, self.collectives
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        ratio_dev = ((logps.detach() - old).exp() - 1).abs() * mask
        ratio_dev = ratio_dev.max() if ratio_dev.numel() else logps.new_zeros(())
        metrics = {"policy/ratio_max_abs_dev": collectives.gather(ratio_dev).max().item()}
        rollout_logps = inputs.get("sampling_per_token_logps")
        if rollout_logps is None:
            return metrics
        preset = args.correction_preset
        log_ratio = masked_log_ratio(old, rollout_logps, mask)
        correction = rollout_correction(log_ratio, mask, preset, args.correction_thresholds())
        sums, maxes = mismatch_stats(old, rollout_logps, mask, correction, log_ratio)
        sums = collectives.reduce(sums, reduction="sum")
        maxes = collectives.gather(maxes[None]).max(dim=0).values
        metrics.update({f"rollout_corr/{name}": value for name, value in finalize_metrics(sums, maxes).items()})
        if preset.applies_weights:
            advantages = inputs["advantages"]
            advantages = advantages[:, None] if advantages.dim() == 1 else advantages
            inputs["advantages"] = advantages * correction.weights.to(advantages.dtype)
        return metrics

    def close(self) -> None:
        self.scope.close()
