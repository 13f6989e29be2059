"""Held-out evaluation over rollouts: mean@k, unbiased pass@k, maj@k, per task, with standard errors."""

from trl_gptoss.evaluation.graders import reward_grader, task_grader, task_graders
from trl_gptoss.evaluation.metrics import accuracy_metrics, majority_correct, pass_at_k, pass_ks
from trl_gptoss.evaluation.run import CORRECT_REWARD, Grader, ProblemResult, evaluate_rows, summarize

__all__ = [
    "CORRECT_REWARD",
    "Grader",
    "ProblemResult",
    "accuracy_metrics",
    "evaluate_rows",
    "majority_correct",
    "pass_at_k",
    "pass_ks",
    "reward_grader",
    "summarize",
    "task_grader",
    "task_graders",
]
