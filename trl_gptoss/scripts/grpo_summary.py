"""The end of a GRPO run: plots, model card, and the before/after summary the job prints.

"Before" and "after" are the mean over the first and the last 20% of GRPO steps (at least one step each) of
what the trainer logged every step: ``reward``, ``tools/call_frequency`` (tool calls per episode) and the
train-inference mismatch ``rollout_corr/abs_logp_diff_max`` (its maximum over the whole run). When the run
evaluated held-out problems, the first and the last evaluation (``eval_*``: mean@k, pass@k, maj@k with their
standard errors) are the held-out "before" and "after". A run that could not learn (``trainer.learning_signal``:
no final answers, or every group's rewards equal) ends the summary with a warning saying why.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from trl_gptoss.plotting import series
from trl_gptoss.trainer.learning_signal import diagnose

WINDOW = 0.2


def _window_means(values: list[float]) -> tuple[float, float]:
    n = max(1, math.ceil(len(values) * WINDOW))
    return sum(values[:n]) / n, sum(values[-n:]) / n


def summarize(history: list[dict]) -> dict:
    """Before/after means and extremes from a log history (``trainer.state.log_history``)."""
    summary = {"steps": len(series(history, "reward")[1])}
    for key, name in (("reward", "reward"), ("tools/call_frequency", "tool_calls_per_episode")):
        values = series(history, key)[1]
        if values:
            summary[f"{name}_first_20pct"], summary[f"{name}_last_20pct"] = _window_means(values)
    for key, name in (
        ("rollout_corr/abs_logp_diff_max", "max_abs_logp_diff"),
        ("policy/ratio_max_abs_dev", "max_ratio_dev"),
    ):
        values = series(history, key)[1]
        if values:
            summary[name] = max(values)
    evaluations = [row for row in history if "eval_problems" in row]
    if evaluations:
        summary["eval_first"], summary["eval_last"] = (_held_out(evaluations[i]) for i in (0, -1))
    cannot_learn = diagnose(history)
    if cannot_learn:
        summary["cannot_learn"] = cannot_learn
    return summary


def _held_out(row: dict) -> dict:
    """One evaluation's overall accuracy (``eval_<metric>`` without the per-task ones) and its step."""
    keep = ("mean@", "pass@", "maj@")
    values = {k.removeprefix("eval_"): v for k, v in row.items() if k.removeprefix("eval_").startswith(keep)}
    return {"step": int(row.get("eval_weights_step", row.get("step", 0))), "problems": row["eval_problems"], **values}


def held_out_lines(summary: dict) -> list[str]:
    """``metric  before -> after (+- stderr)`` of the first and last evaluation, one line per accuracy metric."""
    first, last = summary.get("eval_first"), summary.get("eval_last")
    if not first:
        return []
    names = [k for k in first if k.startswith(("mean@", "pass@", "maj@")) and not k.endswith("_stderr")]
    head = f"held-out ({int(first['problems'])} problems, step {first['step']} -> {last['step']})"
    lines = [head]
    lines += [f"  {name:<22} {_with_error(first, name)} -> {_with_error(last, name)}" for name in names]
    return lines


def _with_error(evaluation: dict, name: str) -> str:
    return f"{evaluation[name]:.3f} +- {evaluation[name + '_stderr']:.3f}"


def format_summary(summary: dict, paths: dict) -> str:
    def pair(name):
        a, b = summary.get(f"{name}_first_20pct"), summary.get(f"{name}_last_20pct")
        return "-" if a is None else f"{a:+.3f} -> {b:+.3f}  (first -> last 20% of {summary['steps']} steps)"

    lines = [
        "",
        "=" * 78,
        f"reward                   {pair('reward')}",
        f"tool calls per episode   {pair('tool_calls_per_episode')}",
        f"max |logp_train - logp_rollout| over the run: {summary.get('max_abs_logp_diff', float('nan')):.2e}",
        f"max |PPO ratio - 1| over the run:            {summary.get('max_ratio_dev', float('nan')):.2e}",
        *held_out_lines(summary),
    ]
    lines += [f"{name:<24} {path}" for name, path in paths.items()]
    lines += [f"WARNING: {message}" for message in summary.get("cannot_learn", ())]
    lines.append("=" * 78)
    return "\n".join(lines)


CARD_FIELDS = (
    "rollout_backend",
    "attn_implementation",
    "experts_implementation",
    "tool_names",
    "max_tool_calling_iterations",
    "vllm_importance_sampling_mode",
    "logprobs_implementation",
    "sp_size",
    "max_staleness",
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "num_iterations",
    "learning_rate",
    "beta",
    "loss_type",
    "max_completion_length",
    "temperature",
    "max_steps",
    "seed",
)


def model_name(args) -> str:
    """What the card calls the trained model: ``hub_model_id`` when set, else the output directory's name."""
    return args.hub_model_id or Path(args.output_dir).resolve().name


def _append_run_section(card: Path, trainer, summary: dict, base: str) -> None:
    """Base checkpoint (a local path, which TRL's card leaves out), the GRPO settings and the before/after numbers."""
    if not card.is_file():
        return
    rows = [f"| `{name}` | `{getattr(trainer.args, name)}` |" for name in CARD_FIELDS if hasattr(trainer.args, name)]
    lines = ["", "## Run", "", f"Base checkpoint: `{base}`", "", "| setting | value |", "|---|---|", *rows, ""]
    for name in ("reward", "tool_calls_per_episode"):
        if f"{name}_first_20pct" in summary:
            lines.append(
                f"- {name.replace('_', ' ')}: {summary[f'{name}_first_20pct']:+.3f} (first 20% of steps) -> "
                f"{summary[f'{name}_last_20pct']:+.3f} (last 20%)"
            )
    if "max_abs_logp_diff" in summary:
        lines.append(f"- max |log p_train - log p_rollout| over the run: {summary['max_abs_logp_diff']:.2e}")
    lines += _held_out_table(summary)
    card.write_text(card.read_text() + "\n".join(lines) + "\n")


def _held_out_table(summary: dict) -> list[str]:
    """The card's results: held-out accuracy at the first and the last evaluation (mean +- standard error)."""
    first, last = summary.get("eval_first"), summary.get("eval_last")
    if not first:
        return []
    names = [k for k in first if k.startswith(("mean@", "pass@", "maj@")) and not k.endswith("_stderr")]
    rows = [f"| {name} | {_with_error(first, name)} | {_with_error(last, name)} |" for name in names]
    title = f"## Held-out evaluation ({int(first['problems'])} problems)"
    return ["", title, "", f"| metric | step {first['step']} | step {last['step']} |", "|---|---|---|", *rows, ""]


def finish_run(trainer, *, base_model: str | None = None, dataset_name: str | None = None, plot: bool = True) -> dict:
    """Write plots (before the model card, which embeds them), the card, ``summary.json``; print the summary.

    ``base_model``: the checkpoint trained from (hub id or local path; default: the model config's
    ``_name_or_path``); ``dataset_name``: the Hub dataset trained on, if any.
    """
    base = base_model or getattr(trainer.model.config, "_name_or_path", None) or "-"
    output_dir = Path(trainer.args.output_dir)
    paths = {"checkpoint": output_dir, "log history": output_dir / "trainer_state.json"}
    if trainer.is_world_process_zero():
        trainer.state.save_to_json(str(output_dir / "trainer_state.json"))
        if plot:
            from trl_gptoss.plotting import plot_runs

            plot_runs([output_dir], output_dir / "plots", labels=[output_dir.name])
            paths["plots"] = output_dir / "plots"
    # the trainer's card: tags, base model, citations, and the plots just written
    trainer.create_model_card(model_name=model_name(trainer.args), dataset_name=dataset_name)
    if trainer.is_world_process_zero():
        _append_run_section(output_dir / "README.md", trainer, summarize(trainer.state.log_history), base)
    paths["model card"] = output_dir / "README.md"
    summary = summarize(trainer.state.log_history)
    summary["paths"] = {k: str(v) for k, v in paths.items()}
    if trainer.is_world_process_zero():
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(format_summary(summary, paths))
    return summary
