"""The GRPO job's held-out evaluation set: ``eval_problems`` problems of the task, never trained on.

Where they come from is the task table's answer: a generated task draws them from a seed of their own (and drops
any that equal a training prompt); a task read from the Hub with a held-out Hub set reads it (ReTool: AIME 2024;
GSM8K: its test split); any other task sets the last ``eval_problems`` of its rows aside from training (with
``dataset_limit``, training keeps the first rows of the others). Every row carries ``task`` (its grader). The
trainer evaluates them at TRL's ``eval_strategy`` / ``eval_steps`` / ``eval_on_start``
(``GptOssGRPOTrainer.evaluate``).
"""

from __future__ import annotations

from trl_gptoss.data.tasks import TASKS
from trl_gptoss.evaluation.run import MAX_CONVERSATIONS, MAX_CONVERSATIONS_REASON, MAX_PROBLEMS

# Generated held-out problems come from this offset of the training seed.
EVAL_SEED_OFFSET = 1_000_003


def held_out_split(job, training, dataset):
    """``(train_dataset, eval_dataset)``; ``eval_dataset`` is None when ``eval_problems`` is 0. ``dataset``: the
    training rows as loaded (``dataset_limit`` applied)."""
    if not job.eval_problems:
        return dataset, None
    task = TASKS[job.task]
    if task.generate is not None:
        drawn = task.load(num_prompts=job.eval_problems, seed=training.seed + EVAL_SEED_OFFSET)
        seen = {_key(p) for p in dataset["prompt"]}
        held_out = drawn.filter(lambda row: _key(row["prompt"]) not in seen)
    elif job.dataset_source == "hub" and task.has_held_out_hub:
        held_out = task.load_held_out(limit=job.eval_problems, hub_id=job.dataset_name)
    else:
        dataset, held_out = _set_aside(job, task, dataset)
    return dataset, held_out.add_column("task", [job.task] * len(held_out))


def _set_aside(job, task, dataset):
    """The last ``eval_problems`` rows of the task's rows held out; training keeps the others (the first
    ``dataset_limit`` of them when set)."""
    rows = dataset
    if job.dataset_limit is not None:  # the rows beyond the limit too: the held-out ones come from the end
        rows = task.load(source=job.dataset_source, hub_id=job.dataset_name)
    if job.eval_problems >= len(rows):
        raise SystemExit(
            f"error: eval_problems={job.eval_problems} sets aside every one of the {len(rows)} rows of "
            f"task={job.task!r}; lower it (the rest is trained on)"
        )
    cut = len(rows) - job.eval_problems
    keep = cut if job.dataset_limit is None else min(cut, job.dataset_limit)
    return rows.select(range(keep)), rows.select(range(cut, len(rows)))


def _key(prompt) -> str:
    return repr(prompt)


def eval_problems(job, training) -> list[str]:
    """The evaluation settings' problems, for ``check_job`` (before any model loads)."""
    problems = []
    count = job.eval_problems
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        return [f"eval_problems={count!r}: give a number of held-out problems >= 0 (0: no evaluation)"]
    if count > MAX_PROBLEMS:
        return [f"eval_problems={count}: at most {MAX_PROBLEMS} held-out problems (every evaluation samples them all)"]
    strategy = str(getattr(training.eval_strategy, "value", training.eval_strategy))
    evaluates = strategy != "no" or training.eval_on_start
    if count and not evaluates:
        problems.append(
            f"eval_problems={count} but nothing evaluates them: set eval_strategy: steps with eval_steps, "
            "and/or eval_on_start: true"
        )
    if evaluates and not count:
        problems.append(
            f"eval_strategy={strategy!r} / eval_on_start={training.eval_on_start} evaluate, but eval_problems is 0: "
            "set eval_problems (held-out problems of the task) or eval_strategy: no"
        )
    from trl_gptoss.trainer.held_out import best_model_metric_problem

    if problem := best_model_metric_problem(training):
        problems.append(problem)
    k = training.num_generations_eval
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        problems.append(f"num_generations_eval={k!r}: give the samples per held-out problem, an integer >= 1")
    elif count * (k or training.num_generations) > MAX_CONVERSATIONS:
        problems.append(
            f"eval_problems={count} x num_generations_eval={k or training.num_generations} conversations exceed "
            f"{MAX_CONVERSATIONS}: {MAX_CONVERSATIONS_REASON}; lower either"
        )
    return problems
