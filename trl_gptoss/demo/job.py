"""Deprecated alias of ``trl_gptoss.scripts.grpo`` (removed in the next release)."""

from trl_gptoss.data.tasks import TASKS as _TASKS
from trl_gptoss.demo._moved import warn_moved
from trl_gptoss.scripts.grpo import (  # noqa: F401
    EMBEDDED_MODEL,
    JobArguments,
    build_embedded_model,
    load_dataset_for,
    main,
    parse_job_args,
    peft_config,
    run,
    set_aside_incomplete_checkpoints,
)

REWARDS = {name: task.reward.__name__ for name, task in _TASKS.items()}


def reward_function(task: str):
    return _TASKS[task].reward


warn_moved(__name__, "trl_gptoss.scripts.grpo")
