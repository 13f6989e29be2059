"""The trainer's ``evaluate()``: held-out problems sampled through the ``Sampler``, graded, logged once.

TRL's ``eval_strategy`` / ``eval_steps`` / ``eval_on_start`` call ``evaluate()``; here it samples every problem of
the evaluation set ``num_generations_eval`` times (default ``num_generations``) at ``eval_temperature`` with the
weights of the step it reports (the ``Sampler`` pushes them first if the engine holds older ones, after any
background batch finished sampling), grades the samples with the row's task (a ``task`` column naming a
``TASKS`` row) or the run's own reward functions, and logs ``eval_<metric>`` and ``eval_<task>/<metric>``
(``trl_gptoss.evaluation``). Evaluation trajectories are never trained on, and a background training batch
keeps its place: evaluation never takes it. Every process evaluates its share of the problems (every
``world``-th row); the results are gathered once and every process computes the same metrics.
"""

from __future__ import annotations

from accelerate.utils import gather_object

from trl_gptoss.evaluation import evaluate_rows, reward_grader, summarize, task_graders
from trl_gptoss.evaluation.run import timed
from trl_gptoss.rollout.config import derive_seed

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
    args, accelerator = trainer.args, trainer.accelerator
    rows = [{**dict(row), "problem": index} for index, row in enumerate(dataset)]
    mine = rows[accelerator.process_index :: accelerator.num_processes]
    graders = task_graders()
    graders[OWN_REWARDS] = reward_grader(OWN_REWARDS, trainer.reward_funcs, trainer.reward_weights.tolist())
    step = trainer.state.global_step
    settings = {"seed": derive_seed(args.seed + EVAL_SEED_SALT, step, accelerator.process_index)}
    if args.eval_temperature is not None:
        settings["temperature"] = args.eval_temperature

    def sample(prompts):
        return trainer.sampler.sample(prompts, step, train=False, settings=settings).rollouts

    k = args.num_generations_eval or args.num_generations
    results, seconds = timed(evaluate_rows, sample, mine, graders, k, OWN_REWARDS)
    if accelerator.num_processes > 1:  # every rank's problems, and the slowest rank's time
        results, seconds = gather_object(results), max(gather_object([seconds]))
    trainer.held_out_results = sorted(results, key=lambda r: r.problem)  # per problem, for inspection
    return summarize(trainer.held_out_results, graders, seconds=seconds) | {"weights_step": float(step)}
