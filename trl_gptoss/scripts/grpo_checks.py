"""``check_job``: the GRPO job's checks, run once before any model loads.

``GptOssGRPOConfig`` validates its own fields in ``__post_init__``; these are the checks of the job's fields
(``JobArguments``), of how they combine with the training config, and of this machine (paths, vLLM install).
Every problem names the key and what to change; all of them are reported at once.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from trl_gptoss.data.tasks import TASKS
from trl_gptoss.scripts.grpo_arguments import EMBEDDED_MODEL, JobArguments
from trl_gptoss.scripts.grpo_eval import eval_problems
from trl_gptoss.trainer.checks import reward_name, reward_weights_problem
from trl_gptoss.trainer.resume import resume_problem
from trl_gptoss.trainer.sampling.servers import server_url_problems


def check_job(job: JobArguments, training) -> None:
    """Refuse values and combinations that would fail late or train silently wrong, before any model loads."""
    problems = _job_field_problems(job) + _task_problems(job, training) + _path_problems(job, training)
    problems += _precision_problems(job, training) + eval_problems(job, training)
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
    elif training.rollout_server_url:
        problems += server_url_problems(training.rollout_server_url)
    if training.sp_size > 1 and job.use_peft:
        problems.append("sp_size > 1 with use_peft is untested here; use one or the other")
    if problems:
        raise SystemExit("error: the configuration cannot run:\n  - " + "\n  - ".join(problems))


def _job_field_problems(job: JobArguments) -> list[str]:
    """Each ``JobArguments`` field on its own."""
    problems = []
    if not isinstance(job.model_name_or_path, str) or not job.model_name_or_path.strip():
        problems.append(
            f"model_name_or_path={job.model_name_or_path!r}: give a hub id, a checkpoint directory or 'embedded'"
        )
    if job.dtype not in ("bfloat16", "float32", "auto"):
        problems.append(f"dtype={job.dtype!r}: choose bfloat16, float32 or auto")
    for name in ("num_prompts", "warmstart_steps", "warmstart_demonstrations", "lora_r"):
        if not _is_int(getattr(job, name)) or getattr(job, name) < 1:
            problems.append(f"{name}={getattr(job, name)!r}: give an integer >= 1")
    if job.dataset_limit is not None and (not _is_int(job.dataset_limit) or job.dataset_limit < 1):
        problems.append(f"dataset_limit={job.dataset_limit!r}: give a number of rows >= 1, or null for all of them")
    if job.warmstart_seed is not None and not _is_int(job.warmstart_seed):
        problems.append(f"warmstart_seed={job.warmstart_seed!r}: give an integer, or null to use seed")
    if not 0.0 <= job.warmstart_tool_fraction <= 1.0:
        problems.append(f"warmstart_tool_fraction={job.warmstart_tool_fraction!r}: give a fraction in [0, 1]")
    for name in ("warmstart_learning_rate", "lora_alpha"):
        value = getattr(job, name)
        if not (_is_number(value) and math.isfinite(value) and value > 0):  # .inf trains the warm-start into NaN
            problems.append(f"{name}={value!r}: give a finite number > 0")
    if not 0.0 <= job.lora_dropout < 1.0:
        problems.append(f"lora_dropout={job.lora_dropout!r}: give a probability in [0, 1)")
    modules = job.lora_target_modules
    if not modules or not all(isinstance(m, str) and m for m in modules):
        problems.append(f"lora_target_modules={modules!r}: give a list of module names, e.g. [q_proj, v_proj]")
    if job.dataset_name is not None and job.dataset_source != "hub":
        problems.append(
            f"dataset_name={job.dataset_name!r} is read only with dataset_source: hub; set that or drop dataset_name"
        )
    return problems


def _precision_problems(job: JobArguments, training) -> list[str]:
    """Precision setups that run but compute worse than the weights allow. (bf16 master weights at an lr they
    cannot represent are judged at train begin, on the prepared parameters: ``trainer/master_weights.py``.)"""
    if training.fp16 and job.dtype == "bfloat16" and job.model_name_or_path != EMBEDDED_MODEL:
        return [
            "fp16: true over dtype: bfloat16 weights casts every bf16 weight to fp16 in each matmul (fp16 keeps "
            "3 more mantissa bits but loses bf16's range: nothing above 65504, nothing below 6e-8) and adds a "
            "loss scaler, for no gain: set bf16: true (fp16: false), or load float32 weights (dtype: float32)"
        ]
    return []


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    # the job trains on the task's one reward function
    if problem := reward_weights_problem(training.reward_weights, [reward_name(task.reward)]):
        problems.append(f"task={job.task!r}: {problem}")
    missing = [tool for tool in task.tools if tool not in (training.tool_names or [])]
    if missing:
        names = ", ".join(missing)
        problems.append(f"task={job.task!r} is solved with the {names} tool: set tool_names: [{names}]")
    return problems


def _path_problems(job: JobArguments, training) -> list[str]:
    """Directories the run writes must be writable, a checkpoint it resumes from must exist and be whole."""
    problems = [p for p in [_unwritable("output_dir", training.output_dir)] if p]
    if job.warmstart_dir is not None and (problem := _unwritable("warmstart_dir", job.warmstart_dir)):
        problems.append(problem)
    resume = training.resume_from_checkpoint
    if resume not in (None, "latest"):
        path = Path(resume)
        fix = "give a checkpoint-N directory, or 'latest' (the newest complete one in output_dir; none: a fresh start)"
        if not path.is_dir():
            problems.append(f"resume_from_checkpoint={resume!r} is not a directory; {fix}")
        elif problem := resume_problem(path, training.max_steps):
            problems.append(f"resume_from_checkpoint={resume!r} cannot be resumed from: {problem}; {fix}")
    return problems


def _unwritable(key: str, directory) -> str | None:
    """A message when ``directory`` cannot be created or written here (tried with a temporary file, which works
    for root too, unlike ``os.access``); ``None`` when it can."""
    path = Path(directory).expanduser().absolute()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{key}={str(directory)!r}: {existing} is a file, not a directory; pick another {key}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".trl-gptoss-write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{key}={str(directory)!r}: cannot write in {existing} ({exc.strerror}); pick a directory you can write"
    return None


def _local_server_problems() -> list[str]:
    """A server started by the trainer needs the server's own environment (``trl-gptoss setup-server``)."""
    try:
        from trl_gptoss.rollout.server import vllm_python

        vllm_python()
        return []
    except (ImportError, FileNotFoundError) as exc:
        return [
            f"rollout_backend=vllm_server starts a vLLM server but none is installed ({exc}); build the "
            "server's environment as said, pass rollout_server_url, or use "
            "--rollout_backend transformers"
        ]
