"""The trainer's ``evaluate()``: held-out problems sampled through the ``Sampler``, graded, logged once.

TRL's ``eval_strategy`` / ``eval_steps`` / ``eval_on_start`` call ``evaluate()``; here it samples every problem of
the evaluation set ``num_generations_eval`` times (default ``num_generations``) at ``eval_temperature`` with the
weights of the step it reports (the ``Sampler`` pushes them first if the engine holds older ones, after any
background batch finished sampling), grades the samples with the row's task (a ``task`` column naming a
``TASKS`` row) or the run's own reward functions, and logs ``eval_<metric>`` and ``eval_<task>/<metric>``
(``trl_gptoss.evaluation``). Evaluation trajectories are never trained on, and a background training batch
keeps its place: evaluation never takes it. Every process joins the weight push first, then evaluates its share of
the problems (every ``world``-th row; possibly none, with a warning); the results are gathered once (a named
collective with the run's ``ddp_timeout``) and every process computes the same metrics.
"""

from __future__ import annotations

import logging

from trl_gptoss.evaluation import evaluate_rows, reward_grader, summarize, task_graders
from trl_gptoss.evaluation.run import timed
from trl_gptoss.named_collectives import all_gather_object
from trl_gptoss.rollout.config import derive_seed

logger = logging.getLogger(__name__)

# Evaluation samples with seeds of their own (never those of the training batch of the same step).
EVAL_SEED_SALT = 0x5EED_E7A1
OWN_REWARDS = "rewards"  # the grader name of rows that name no task


def evaluate_held_out(trainer, eval_dataset=None, metric_key_prefix: str = "eval") -> dict:
    """``Trainer.evaluate`` for ``GptOssGRPOTrainer``: returns (and logs) the metrics."""
    dataset = eval_dataset if eval_dataset is not None else trainer.eval_dataset
    if dataset is None:
        raise ValueError("evaluate() needs an eval_dataset (pass one to the trainer or to evaluate())")
    if isinstance(dataset, dict):  # TRL's several named evaluation sets
        metrics = {}
        for name, one in dataset.items():
            metrics.update(evaluate_held_out(trainer, one, f"{metric_key_prefix}_{name}"))
        return metrics
    training = trainer.model.training
    trainer.model.eval()  # TRL's log() files what is logged meanwhile (the Sampler's timings too) under "eval"
    try:
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in _evaluate(trainer, dataset).items()}
        trainer.log(metrics)
    finally:
        trainer.model.train(training)
    trainer.control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, metrics)
    return metrics


def _evaluate(trainer, dataset) -> dict:
    world, step = trainer.accelerator, trainer.state.global_step
    rows = [{**dict(row), "problem": index} for index, row in enumerate(dataset)]
    graders = run_graders(trainer)
    if not rows[world.process_index :: world.num_processes]:
        logger.warning(
            "rank %d has none of the %d held-out problems (%d processes): it joins the weight push and the gather "
            "with nothing to sample; more problems than processes keep every rank busy",
            world.process_index,
            len(rows),
            world.num_processes,
        )
    trainer.sampler.push(step)  # collective: every rank joins it, whatever its share, before anything else
    results, seconds = timed(evaluate_share, trainer, rows, graders, world.process_index, world.num_processes)
    if world.num_processes > 1:  # every rank's problems, and the slowest rank's time
        shares = all_gather_object(
            (results, seconds), name="held-out evaluation: every rank's results", timeout_s=trainer.args.ddp_timeout
        )
        results, seconds = [r for share, _ in shares for r in share], max(s for _, s in shares)
    trainer.held_out_results = sorted(results, key=lambda r: r.problem)  # per problem, for inspection
    return summarize(trainer.held_out_results, graders, seconds=seconds) | {"weights_step": float(step)}


def run_graders(trainer) -> dict:
    """Every task's grader, and the run's own rewards for rows that name no task."""
    graders = task_graders()
    graders[OWN_REWARDS] = reward_grader(OWN_REWARDS, trainer.reward_funcs, trainer.reward_weights.tolist())
    return graders


def evaluate_share(trainer, rows: list[dict], graders: dict, share: int, shares: int) -> list:
    """The ``ProblemResult``s of share ``share`` of ``shares`` (rows ``share::shares``), sampled with that share's
    seed stream at the trainer's current step: the part of an evaluation one process computes (none for an
    empty share: the push already happened)."""
    args, step = trainer.args, trainer.state.global_step
    settings = {"seed": derive_seed(args.seed + EVAL_SEED_SALT, step, share)}
    if args.eval_temperature is not None:
        settings["temperature"] = args.eval_temperature

    def sample(prompts):
        return trainer.sampler.sample(prompts, step, train=False, settings=settings).rollouts

    k = args.num_generations_eval or args.num_generations
    return evaluate_rows(sample, rows[share::shares], graders, k, OWN_REWARDS)


def best_model_metric_problem(args) -> str | None:
    """Why ``metric_for_best_model`` cannot be followed, or None. ``evaluate()`` reports held-out accuracy, not
    TRL's ``eval_loss``: the GRPO loss of freshly sampled evaluation groups is about ``beta * KL`` by construction
    (advantages are normalised within each group and the ratio is 1), so a "best" checkpoint by it is noise, and
    computing it would sample the evaluation set a second time. ``load_best_model_at_end`` (and transformers'
    default of ``metric_for_best_model: loss`` that comes with it) is refused before training, naming what is
    logged instead."""
    metric = args.metric_for_best_model
    if metric not in ("loss", "eval_loss"):
        return None
    k = args.num_generations_eval or args.num_generations
    why = " (load_best_model_at_end=True defaults it to 'loss')" if args.load_best_model_at_end else ""
    return (
        f"metric_for_best_model={metric!r}{why}, but evaluate() logs held-out accuracy, not eval_loss (the GRPO loss "
        "of sampled evaluation groups is about beta*KL by construction: it ranks checkpoints by noise). Set "
        f"metric_for_best_model to one it logs, with greater_is_better=True: 'eval_mean@{k}', 'eval_pass@1', "
        f"'eval_reward', or per task 'eval_<task>/mean@{k}' (with several evaluation sets: 'eval_<set>_mean@{k}')"
    )
