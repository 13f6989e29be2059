"""The GRPO job: config -> dataset -> model -> ``GptOssGRPOTrainer`` -> checkpoint, plots, model card, summary.

``examples/retool_grpo.py`` and ``trl-gptoss grpo`` run ``main(argv)``; every scale is this job with another
YAML. ``model_name_or_path: embedded`` is the CPU demo: a tiny GPT-OSS built offline and warm-started
(``trl_gptoss.demo``), then trained and served by vLLM like any checkpoint.

Stopping: Ctrl-C and SIGTERM both stop the rollout server and leave the checkpoints saved so far as they were
(exit status 130 / 143; a job started with SIGINT ignored -- ``cmd &`` in a script -- says Ctrl-C cannot stop
it); a SIGKILL leaves the server to its watchdog (``trl_gptoss.rollout.server``). Every
start sets aside checkpoints cut off during their save (``incomplete-checkpoint-N``) before it resumes, so
``resume_from_checkpoint: latest`` picks the newest complete one -- or starts afresh when there is none.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

from trl_gptoss.data.tasks import TASKS
from trl_gptoss.scripts.grpo_arguments import EMBEDDED_MODEL, JobArguments
from trl_gptoss.scripts.grpo_checks import check_job
from trl_gptoss.scripts.grpo_eval import held_out_split
from trl_gptoss.scripts.grpo_parser import parse_job_args
from trl_gptoss.trainer.resume import (
    STATE_FILE,
    Terminated,
    beyond_max_steps,
    set_aside_incomplete_checkpoints,
    sigterm_as_interrupt,
)

__all__ = [
    "EMBEDDED_MODEL",
    "JobArguments",
    "build_embedded_model",
    "check_job",
    "end_distributed",
    "exit_launched_job",
    "load_dataset_for",
    "main",
    "parse_job_args",
    "peft_config",
    "resume_checkpoint",
    "run",
    "set_aside_incomplete_checkpoints",
    "warn_if_ctrl_c_is_ignored",
]

logger = logging.getLogger(__name__)


def load_dataset_for(job: JobArguments, seed: int):
    """The prompts (TRL conversational ``prompt`` column) and the reward's ground-truth column."""
    task = TASKS[job.task]
    if task.generate is not None:
        return task.load(num_prompts=job.num_prompts, seed=seed, limit=job.dataset_limit)
    return task.load(source=job.dataset_source, limit=job.dataset_limit, hub_id=job.dataset_name)


def build_embedded_model(job: JobArguments, training, tokenizer) -> str:
    """The tiny GPT-OSS warm-started on demonstrations, saved in ``warmstart_dir`` (``OUTPUT_DIR/warmstart``).

    Cached: a second run with the same warm-start settings and seed reuses the saved checkpoint.
    """
    from trl_gptoss.demo.warmstart import WarmStartConfig, warm_started_checkpoint

    config = WarmStartConfig(
        num_demonstrations=job.warmstart_demonstrations,
        tool_fraction=job.warmstart_tool_fraction,
        steps=job.warmstart_steps,
        learning_rate=job.warmstart_learning_rate,
        seed=training.seed if job.warmstart_seed is None else job.warmstart_seed,
    )
    path = Path(job.warmstart_dir or Path(training.output_dir) / "warmstart")
    return str(warm_started_checkpoint(tokenizer, config, path, progress=not training.disable_tqdm))


def peft_config(job: JobArguments):
    if not job.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=job.lora_r,
        lora_alpha=job.lora_alpha,
        lora_dropout=job.lora_dropout,
        target_modules=list(job.lora_target_modules),
        task_type="CAUSAL_LM",
    )


def _tokenizer(job: JobArguments):
    if job.model_name_or_path == EMBEDDED_MODEL:
        from trl_gptoss.harmony import harmony_tokenizer

        return harmony_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(job.model_name_or_path)


def _hub_dataset_name(job: JobArguments) -> str | None:
    hub = TASKS[job.task].hub
    return (job.dataset_name or hub.path) if job.dataset_source == "hub" and hub is not None else None


def _model_init_dtype(job: JobArguments, training) -> None:
    if job.model_name_or_path != EMBEDDED_MODEL:
        init = dict(training.model_init_kwargs or {})
        init.setdefault("dtype", job.dtype)
        training.model_init_kwargs = init


def resume_checkpoint(training) -> str | None:
    """The checkpoint this start resumes from, after the main process set incomplete ones aside
    (``trl_gptoss.trainer.resume``, the rule the trainer applies too).

    ``resume_from_checkpoint``: ``None`` (start afresh), a ``checkpoint-N`` path (checked by ``check_job``), or
    ``"latest"``: the newest complete ``checkpoint-N`` in ``output_dir``, ``None`` when there is none (so the
    same command line starts a run and restarts it after preemption); one past ``max_steps`` is refused.
    """
    from transformers.trainer_utils import get_last_checkpoint

    with training.main_process_first(desc="set incomplete checkpoints aside"):
        if training.should_save and Path(training.output_dir).is_dir():
            for path in set_aside_incomplete_checkpoints(training.output_dir):
                logger.warning("a checkpoint cut off during its save is set aside as %s", path)
    resume = training.resume_from_checkpoint
    if resume != "latest":
        return resume
    latest = get_last_checkpoint(training.output_dir) if Path(training.output_dir).is_dir() else None
    if latest is None:
        logger.warning("resume_from_checkpoint=latest: no checkpoint in %s yet; starting afresh", training.output_dir)
        return None
    step = json.loads((Path(latest) / STATE_FILE).read_text(encoding="utf-8"))["global_step"]  # whole: set aside
    if problem := beyond_max_steps(step, training.max_steps):
        raise SystemExit(f"error: resume_from_checkpoint=latest picks {latest}: {problem}")
    return latest


def warn_if_ctrl_c_is_ignored() -> bool:
    """Warn (and return True) when SIGINT is ignored in this process, so Ctrl-C cannot stop the job.

    A shell without job control (a script, CI) starts a background command (``cmd &``) with SIGINT ignored, and
    Python keeps a signal ignored that it inherited so: Ctrl-C, or SIGINT sent to the job's process group, then
    does nothing and the run trains on. That is the convention for background jobs, kept here; SIGTERM still
    stops the run (exit status 143)."""
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        return False
    logger.warning(
        "SIGINT is ignored in this process (it was started as a background job of a shell without job control): "
        "Ctrl-C will not stop this run; stop it with SIGTERM (kill PID), or start it in the foreground"
    )
    return True


def run(job: JobArguments, training) -> dict:
    """Train; returns the summary (also printed). The trainer's server is stopped whatever happens; SIGTERM
    stops the run as Ctrl-C does, then exits with status 143."""
    warn_if_ctrl_c_is_ignored()
    with sigterm_as_interrupt():
        try:
            return _train(job, training)
        except Terminated:
            raise SystemExit(128 + signal.SIGTERM) from None


def _train(job: JobArguments, training) -> dict:
    import trl_gptoss  # noqa: F401  (registers fa3_sink and gptoss_sequential)
    import trl_gptoss.demo.ablation  # noqa: F401  (registers the "sinkless" attention of the ablation)
    from trl_gptoss.scripts.grpo_summary import finish_run
    from trl_gptoss.trainer import GptOssGRPOTrainer

    resume = resume_checkpoint(training)
    tokenizer = _tokenizer(job)
    model = (
        build_embedded_model(job, training, tokenizer)
        if job.model_name_or_path == EMBEDDED_MODEL
        else job.model_name_or_path
    )
    _model_init_dtype(job, training)
    dataset, eval_dataset = held_out_split(job, training, load_dataset_for(job, seed=training.seed))
    trainer = GptOssGRPOTrainer(
        model=model,
        reward_funcs=[TASKS[job.task].reward],
        args=training,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config(job),
    )
    try:
        trainer.train(resume_from_checkpoint=resume)
        trainer.save_model(training.output_dir)
        return finish_run(trainer, base_model=model, dataset_name=_hub_dataset_name(job), plot=job.plot)
    except KeyboardInterrupt as stop:
        cause = "SIGTERM" if isinstance(stop, Terminated) else "Ctrl-C"
        print(
            f"\ninterrupted ({cause}): the rollout server is being stopped; checkpoints saved so far are in "
            f"{training.output_dir} (resume with --resume_from_checkpoint latest)",
            flush=True,
        )
        if training.should_save:
            for path in set_aside_incomplete_checkpoints(training.output_dir):
                print(f"interrupted while saving: {path} is incomplete, kept under that name for inspection")
        raise
    finally:
        trainer.close()


def end_distributed() -> None:
    """Destroy the process group a launched job trained in, as torch asks every process to before it exits:
    without it gloo's worker threads can abort the interpreter's shutdown (SIGABRT, "terminate called without
    an active exception"; the rank's launcher then fails and its peers wait out torchelastic's exit barrier), and
    an NCCL rank leaving first can block its peers. Call it once the job's runs succeeded (not after a failure: a
    rank stopped inside a collective would leave the others waiting here), at the end of a command, not after
    each ``run`` (``sink_ablation`` runs twice)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_launched_job() -> None:
    """End a launched job's process after it succeeded: Python's exit handlers first (logging, trackers, the
    server and sandbox clean-ups registered with ``atexit``), then ``os._exit(0)``, skipping the interpreter's
    teardown. In 2-process gloo runs that teardown aborted now and then even after ``end_distributed``
    (``std::terminate``, "terminate called without an active exception": a C++ thread destroyed while joinable;
    seen in about 1 of 10 recipe rehearsals), so the launcher reported a failure after every output was written.
    For the ``__main__`` of launched scripts only: it never returns."""
    import atexit
    import os
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> dict:
    job, training = parse_job_args(argv)
    summary = run(job, training)
    end_distributed()
    return summary
