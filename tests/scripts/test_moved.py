"""The job moved from ``trl_gptoss.demo`` to ``trl_gptoss.scripts``: the old paths still work, with a warning."""

import importlib
import sys

import pytest

from trl_gptoss.data import TASKS
from trl_gptoss.scripts import cli_commands, grpo, grpo_summary

MOVED = {
    "trl_gptoss.demo.job": (grpo, ["main", "run", "set_aside_incomplete_checkpoints", "load_dataset_for"]),
    "trl_gptoss.demo.arguments": (grpo, ["JobArguments", "parse_job_args", "check_job", "EMBEDDED_MODEL"]),
    "trl_gptoss.demo.summary": (grpo_summary, ["finish_run", "summarize", "format_summary"]),
    "trl_gptoss.demo.cli_commands": (cli_commands, ["register"]),
}


@pytest.mark.parametrize("old", list(MOVED))
def test_old_import_path_warns_and_gives_the_same_objects(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to trl_gptoss\.scripts"):
        module = importlib.import_module(old)
    new, names = MOVED[old]
    for name in names:
        assert getattr(module, name) is getattr(new, name), name


def test_old_task_tables_are_views_of_the_one_table():
    with pytest.warns(DeprecationWarning):
        arguments = importlib.reload(importlib.import_module("trl_gptoss.demo.arguments"))
        job = importlib.reload(importlib.import_module("trl_gptoss.demo.job"))
    assert tuple(TASKS) == arguments.TASKS and arguments.TASKS_NEEDING_PYTHON == ("arithmetic", "retool")
    assert job.REWARDS == {
        "arithmetic": "retool_reward",
        "retool": "retool_reward",
        "gsm8k": "gsm8k_reward",
        "verifyif": "verifyif_reward",
    }
    assert job.reward_function("gsm8k") is TASKS["gsm8k"].reward
