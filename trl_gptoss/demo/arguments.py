"""Deprecated alias of ``trl_gptoss.scripts.grpo_arguments`` / ``grpo_checks`` (removed in the next release)."""

from trl_gptoss.data.tasks import TASKS as _TASKS
from trl_gptoss.demo._moved import warn_moved
from trl_gptoss.scripts.grpo_arguments import EMBEDDED_MODEL, JobArguments  # noqa: F401
from trl_gptoss.scripts.grpo_parser import parse_job_args  # noqa: F401
from trl_gptoss.scripts.grpo_checks import check_job  # noqa: F401

TASKS = tuple(_TASKS)
TASKS_NEEDING_PYTHON = tuple(name for name, task in _TASKS.items() if "python" in task.tools)

warn_moved(__name__, "trl_gptoss.scripts.grpo_arguments")
