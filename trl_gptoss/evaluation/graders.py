"""Graders: how a task's samples are scored -- the task table's reward and answer reader, or a run's own rewards."""

from __future__ import annotations

from trl_gptoss.data.tasks import TASKS, same_answer
from trl_gptoss.evaluation.run import Grader
from trl_gptoss.rewards.checked import checked_reward


def task_grader(name: str) -> Grader:
    """The grader of ``TASKS[name]``: its reward, and its final answers for maj@k when it has them."""
    task = TASKS[name]
    return Grader(name, task.reward, task.answer, same_answer if task.answer is not None else None)


def task_graders() -> dict[str, Grader]:
    return {name: task_grader(name) for name in TASKS}


def reward_grader(name: str, reward_funcs, weights=None) -> Grader:
    """A grader from a run's own reward functions (TRL's weighted sum, as training scores), each checked as training
    checks it (``checked_reward``: a refused value raises naming that function): for an evaluation set that names
    no task. A function that cannot score a completion (None) leaves the sample unscored. No answers to vote on:
    no maj@k."""
    reward_funcs = [checked_reward(func) for func in reward_funcs]
    weights = list(weights) if weights is not None else [1.0] * len(reward_funcs)

    def reward(**kwargs) -> list:
        total = 0.0
        for weight, func in zip(weights, reward_funcs):
            (value,) = func(**kwargs)
            if value is None:
                return [None]
            total += weight * float(value)
        return [total]

    reward.__name__ = name
    return Grader(name, reward)
