"""The one piece of state the loss hooks share: created by ``_compute_loss``, read by the log-prob hook.

TRL's ``_compute_loss`` calls ``_get_per_token_logps_and_entropies`` for the policy's log-probs; the trainer
needs, inside that call, the micro-batch's inputs (to apply rollout correction to its advantages), the
log-probs the SP runner already computed (if any), and a scope that keeps R3 replay hooks alive until the
backward pass has re-run the routers (gradient checkpointing). ``LossPass`` carries exactly that.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class LossPass:
    """One micro-batch's loss computation.

    ``inputs``: a shallow copy of TRL's batch dict (the correction replaces its ``"advantages"``; TRL reuses the
    buffered original for every iteration). ``logps``, ``entropies``: ``[B, T]`` completion log-probs and
    entropies computed elsewhere (SP), or None. ``scope``: contexts that must outlive the forward (closed after
    backward, or at once in eval).
    """

    inputs: dict
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    scope: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    logps_taken: bool = False

    def take_policy_call(self) -> bool:
        """True for the first log-prob call of this pass (the policy's); later calls are not the loss's."""
        first = not self.logps_taken
        self.logps_taken = True
        return first

    def close(self) -> None:
        self.scope.close()
