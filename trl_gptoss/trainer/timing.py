"""``timing/*`` metrics: where a GRPO step's wall time goes, logged beside TRL's metrics every step.

Phases (seconds, averaged over the logging interval like every TRL metric):
``timing/weight_push``, ``timing/generation`` (rollouts incl. tool calls, wall clock), ``timing/tool_calls``
(tool seconds summed over conversations: > generation when calls overlap), ``timing/rewards``,
``timing/old_logprobs`` (old/reference log-prob passes, when they run), ``timing/loss_forward_backward``
(one micro-batch's loss pass, from its inputs being ready to the end of its backward) and ``timing/optimizer``.
"""

from __future__ import annotations

import contextlib
import time

from transformers import TrainerCallback


class PhaseTimer:
    """Appends the seconds of each ``phase(name)`` block to ``trainer._metrics[mode]["timing/<name>"]``."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """Remember now under ``name``; ``since(name, phase)`` records the time elapsed from it."""
        self._marks[name] = time.perf_counter()

    def since(self, mark: str, name: str) -> None:
        start = self._marks.pop(mark, None)
        if start is not None:
            self.record(name, time.perf_counter() - start)

    def record(self, name: str, seconds: float) -> None:
        mode = "train" if self.trainer.model.training else "eval"
        self.trainer._metrics[mode][f"timing/{name}"].append(seconds)

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, time.perf_counter() - start)


class OptimizerTimer(TrainerCallback):
    """Times ``optimizer.step()`` (between Trainer's ``on_pre_optimizer_step`` and ``on_optimizer_step``)."""

    def __init__(self, timer: PhaseTimer):
        self.timer = timer
        self._start = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._start is not None:
            self.timer.record("optimizer", time.perf_counter() - self._start)
            self._start = None
