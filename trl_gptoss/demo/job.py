"""The main GRPO job: config -> dataset -> model -> ``GptOssGRPOTrainer`` -> checkpoint, plots, model card.

``examples/retool_grpo.py`` and ``trl-gptoss grpo`` both run ``main(argv)``; the CPU demo is the same job on
``model_name_or_path: embedded`` (a tiny GPT-OSS built offline and warm-started here, then served by vLLM
like any checkpoint). Ctrl-C stops the rollout server and leaves the last saved checkpoint as it was.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path

from trl_gptoss.demo.arguments import EMBEDDED_MODEL, JobArguments, parse_job_args

logger = logging.getLogger(__name__)

REWARDS = {
    "arithmetic": "retool_reward",
    "retool": "retool_reward",
    "gsm8k": "gsm8k_reward",
    "verifyif": "verifyif_reward",
}


def load_dataset_for(job: JobArguments, seed: int):
    """The prompts (TRL conversational ``prompt`` column) and the reward's ground-truth column."""
    if job.task == "arithmetic":
        from trl_gptoss.demo.task import arithmetic_dataset

        return arithmetic_dataset(job.num_prompts, seed=seed)
    from trl_gptoss.data import load_task_dataset

    return load_task_dataset(job.task, source=job.dataset_source, limit=job.dataset_limit, hub_id=job.dataset_name)


def reward_function(task: str):
    import trl_gptoss.rewards as rewards

    return getattr(rewards, REWARDS[task])


def build_embedded_model(job: JobArguments, training, tokenizer) -> str:
    """Build the tiny GPT-OSS, warm-start it on demonstrations, save it to ``OUTPUT_DIR/warmstart``.

    Cached: a second run with the same seed and warm-start settings reuses the saved checkpoint.
    """
    import json

    from trl_gptoss.demo.model import build_tiny_gpt_oss, save_checkpoint
    from trl_gptoss.demo.warmstart import WarmStartConfig, warm_start

    seed = training.seed if job.warmstart_seed is None else job.warmstart_seed
    config = WarmStartConfig(
        num_demonstrations=job.warmstart_demonstrations,
        tool_fraction=job.warmstart_tool_fraction,
        steps=job.warmstart_steps,
        learning_rate=job.warmstart_learning_rate,
        seed=seed,
    )
    path = Path(job.warmstart_dir or Path(training.output_dir) / "warmstart")
    stamp = path / "warmstart.json"
    wanted = dict(config.__dict__)  # the seed is one of its fields
    if stamp.is_file() and json.loads(stamp.read_text()).get("config") == wanted:
        logger.info("reusing the warm-started model in %s", path)
        return str(path)
    # the warm start stands for pre-training: always exact sink attention, whatever the RL run trains with
    model = build_tiny_gpt_oss(tokenizer, seed=seed, attn_implementation="fa3_sink")
    model.set_experts_implementation("gptoss_sequential")
    start = time.perf_counter()
    losses = warm_start(model, tokenizer, config, progress=not training.disable_tqdm)
    save_checkpoint(model, tokenizer, path)
    stamp.write_text(json.dumps({"config": wanted, "losses": losses, "seconds": time.perf_counter() - start}))
    return str(path)


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


def _model_init_dtype(job: JobArguments, training) -> None:
    if job.model_name_or_path != EMBEDDED_MODEL:
        init = dict(training.model_init_kwargs or {})
        init.setdefault("dtype", job.dtype)
        training.model_init_kwargs = init


def set_aside_incomplete_checkpoints(output_dir) -> list[Path]:
    """Rename ``checkpoint-N`` folders without ``trainer_state.json`` to ``checkpoint-N.incomplete``.

    The Trainer writes a checkpoint in place and ``trainer_state.json`` last, so a Ctrl-C during a save leaves a
    partial ``checkpoint-N``, which ``--resume_from_checkpoint latest`` would pick (and fail to load) as the
    newest; renamed, it no longer matches ``checkpoint-<digits>`` and the newest complete checkpoint is used.
    A stale ``checkpoint-N.incomplete`` from an earlier interrupted save of the same step is replaced.
    """
    moved = []
    for path in sorted(Path(output_dir).glob("checkpoint-*")):
        if re.fullmatch(r"checkpoint-\d+", path.name) and path.is_dir() and not (path / "trainer_state.json").exists():
            target = path.with_name(f"{path.name}.incomplete")
            if target.exists():  # an earlier interrupted save of the same step: no more use than this one
                shutil.rmtree(target)
            path.rename(target)
            moved.append(target)
    return moved


def run(job: JobArguments, training) -> dict:
    """Train; returns the summary (also printed). The trainer's server is stopped whatever happens."""
    import trl_gptoss  # noqa: F401  (registers fa3_sink and gptoss_sequential)
    import trl_gptoss.demo.ablation  # noqa: F401  (registers the "sinkless" attention of the ablation)
    from trl_gptoss.demo.summary import finish_run
    from trl_gptoss.trainer import GptOssGRPOTrainer

    tokenizer = _tokenizer(job)
    model = (
        build_embedded_model(job, training, tokenizer)
        if job.model_name_or_path == EMBEDDED_MODEL
        else job.model_name_or_path
    )
    _model_init_dtype(job, training)
    dataset = load_dataset_for(job, seed=training.seed)
    trainer = GptOssGRPOTrainer(
        model=model,
        reward_funcs=[reward_function(job.task)],
        args=training,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config(job),
    )
    try:
        resume = training.resume_from_checkpoint  # TrainingArguments' field; "latest" = newest in output_dir
        trainer.train(resume_from_checkpoint=True if resume == "latest" else resume)
        trainer.save_model(training.output_dir)
        return finish_run(trainer, plot=job.plot)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: the rollout server is being stopped; checkpoints saved so far are in "
            f"{training.output_dir} (resume with --resume_from_checkpoint latest)"
        )
        if training.should_save:
            for path in set_aside_incomplete_checkpoints(training.output_dir):
                print(f"interrupted while saving: {path} is incomplete, kept under that name for inspection")
        raise
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> dict:
    job, training = parse_job_args(argv)
    return run(job, training)
