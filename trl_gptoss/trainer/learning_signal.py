"""A run that cannot learn is said once, loudly, not left to a metric nobody reads.

GRPO learns from the differences between the rewards of one prompt's completions. Two logged signs that there
are none:

- ``rollout/final_answer_fraction`` is 0: no completion wrote a Harmony ``final`` message. The rewards see only
  the final answer (``rewards.completion_text``; ``completions`` carries the final message only), so every
  completion scored as ``""``, every group's rewards are equal and the loss is 0. Seen with models never taught
  Harmony (TRL's own tiny test models, an untaught or broken checkpoint) and with a prompt format that confuses
  the model.
- ``frac_reward_zero_std`` (TRL's share of groups whose rewards are all equal) is 1 for ``FLAT_LOGS`` logged rows
  in a row: every advantage is 0, nothing trains (all completions right, all wrong, or a constant reward).

``diagnose(history)`` reads a log history (``trainer.state.log_history``) and returns what it finds, one message
per cause; ``LearningSignalCallback`` warns as soon as a cause shows up (each once per run, on the main process)
and the job's summary repeats ``diagnose`` of the whole run.
"""

from __future__ import annotations

import logging
import warnings

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

FLAT_LOGS = 3  # logged rows in a row with every group's rewards equal

NO_FINAL_ANSWER = (
    "this run cannot learn: at step {step} no completion wrote a final answer (rollout/final_answer_fraction = 0). "
    "The rewards score only the Harmony final message, so every completion scored as an empty answer, every "
    "group's rewards are equal and the loss is 0. Start from a checkpoint that writes Harmony "
    "`<|channel|>final` messages (a warm-start), check the prompt format (the chat template / Harmony system "
    "message the model was trained with), or, for a reward that needs the whole completion, read the `messages` "
    "column instead of `completions`."
)
FLAT_REWARDS = (
    "this run cannot learn: every group's rewards were equal for {n} logged steps in a row (up to step {step}; "
    "frac_reward_zero_std = 1), so every advantage is 0 and nothing trains. The task is all right or all wrong for "
    "this model, or a reward returns a constant: check the rewards on a few completions, the difficulty of the "
    "task, num_generations and the sampling temperature."
)


class _Scan:
    """The causes found so far in the rows read (``cause -> message``, first occurrence)."""

    def __init__(self):
        self.found: dict[str, str] = {}
        self._flat = 0

    def read(self, row: dict) -> list[str]:
        """Read one logged row; returns the causes it shows for the first time."""
        new, step = [], row.get("step", "?")
        if row.get("rollout/final_answer_fraction") == 0 and "no_final_answer" not in self.found:
            self.found["no_final_answer"] = NO_FINAL_ANSWER.format(step=step)
            new.append("no_final_answer")
        if "frac_reward_zero_std" in row:
            self._flat = self._flat + 1 if row["frac_reward_zero_std"] >= 1.0 else 0
            if self._flat >= FLAT_LOGS and "flat_rewards" not in self.found:
                self.found["flat_rewards"] = FLAT_REWARDS.format(n=self._flat, step=step)
                new.append("flat_rewards")
        return new


def diagnose(history: list[dict]) -> list[str]:
    """What says that the run logged in ``history`` could not learn (one message per cause, first occurrence)."""
    scan = _Scan()
    for row in history:
        scan.read(row)
    return list(scan.found.values())


class LearningSignalCallback(TrainerCallback):
    """Warns once per cause, on the main process, as soon as a logged row shows it."""

    def __init__(self):
        self._scan = _Scan()

    @property
    def said(self) -> list[str]:
        return list(self._scan.found.values())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        for cause in self._scan.read({**logs, "step": state.global_step}):
            message = self._scan.found[cause]
            logger.warning(message)
            warnings.warn(message, stacklevel=2)
