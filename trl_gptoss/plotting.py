"""Training curves like the GPT-OSS agentic-RL retrospective's figures, from a trainer's log history.

``plot_runs([run_dir, ...], out_dir)`` reads each run's ``trainer_state.json`` (the run directory's own, else
its newest ``checkpoint-*``), and writes one PNG per metric panel, every run overlaid, plus an overview grid
(``overview.png``). A panel is drawn when at least one run logged one of its keys; the first key a run has
is the one plotted for it (e.g. the IS clip fraction of the rollout correction, else TRL's PPO clip ratio).
Matplotlib runs headless (Agg); nothing opens a window.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    """One figure: ``keys`` are log-history names tried in order; ``file`` is the PNG's stem."""

    file: str
    title: str
    keys: tuple[str, ...]
    log_scale: bool = False


# Held-out accuracy is logged as eval_mean@k / eval_pass@k with the run's k.
_KS = tuple(range(1, 129))

PANELS = (
    Panel("reward", "Average reward in a batch", ("reward",)),
    Panel("eval_accuracy", "Held-out accuracy (mean@k)", tuple(f"eval_mean@{k}" for k in _KS)),
    Panel("eval_pass_at_k", "Held-out pass@k (largest k)", tuple(f"eval_pass@{k}" for k in reversed(_KS))),
    Panel("grad_norm", "Gradient norm", ("grad_norm",), log_scale=True),
    Panel("entropy", "Average entropy", ("entropy",)),
    Panel("kl", "KL to the reference policy", ("kl",)),
    Panel("mismatch_kl", "Train-inference mismatch KL (k3)", ("rollout_corr/kl_k3",)),
    Panel(
        "max_abs_logp_diff",
        "Max |log p_train - log p_rollout| in a batch",
        ("rollout_corr/abs_logp_diff_max",),
        log_scale=True,
    ),
    Panel(
        "is_clip_fraction",
        "Importance-sampling clip fraction",
        ("rollout_corr/is_clip_fraction", "clip_ratio/region_mean"),
    ),
    Panel("tool_calls", "Tool calls per episode", ("tools/call_frequency",)),
)


def find_trainer_state(run_dir) -> Path:
    """``run_dir/trainer_state.json``, else the one in the newest ``checkpoint-N`` (highest N)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    direct = run_dir / "trainer_state.json"
    if direct.is_file():
        return direct
    checkpoints = sorted(
        run_dir.glob("checkpoint-*/trainer_state.json"),
        key=lambda p: int(p.parent.name.split("-")[-1]) if p.parent.name.split("-")[-1].isdigit() else -1,
    )
    if not checkpoints:
        raise FileNotFoundError(
            f"no trainer_state.json in {run_dir} or its checkpoint-* directories; "
            "is it the output_dir of a training run that logged at least one step?"
        )
    return checkpoints[-1]


def load_log_history(run_dir) -> list[dict]:
    """The training-step entries of the run's log history (entries with a ``step`` and some metric)."""
    state = json.loads(find_trainer_state(run_dir).read_text())
    return [entry for entry in state.get("log_history", []) if "step" in entry and len(entry) > 2]


def series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``, skipping entries without it and non-finite values."""
    steps, values = [], []
    for entry in history:
        value = entry.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(entry["step"])
            values.append(float(value))
    return steps, values


def ema(values: list[float], weight: float = 0.8) -> list[float]:
    """Exponential moving average (TensorBoard/W&B-style smoothing) with bias correction."""
    out, acc = [], 0.0
    for i, value in enumerate(values, start=1):
        acc = weight * acc + (1 - weight) * value
        out.append(acc / (1 - weight**i))
    return out


def _draw_panel(ax, panel: Panel, runs: dict[str, list[dict]]) -> bool:
    drawn = False
    for index, (label, history) in enumerate(runs.items()):
        key = next((k for k in panel.keys if series(history, k)[0]), None)
        if key is None:
            continue
        steps, values = series(history, key)
        color = f"C{index % 10}"
        if len(values) >= 10:
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, ema(values), color=color, linewidth=2, label=label)
        else:
            ax.plot(steps, values, color=color, linewidth=2, marker="o", markersize=3, label=label)
        drawn = True
    if drawn:
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if panel.log_scale and all(v > 0 for h in runs.values() for k in panel.keys for v in series(h, k)[1]):
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    return drawn


def plot_runs(run_dirs, out_dir, labels=None) -> list[Path]:
    """Write ``<panel>.png`` for every panel some run logged, and ``overview.png``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise ValueError("give at least one run directory to plot")
    labels = list(labels) if labels else [d.name or str(d) for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} run directories; give one label per run")
    runs = {label: load_log_history(d) for label, d in zip(labels, run_dirs)}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written, drawn_panels = [], []
    for panel in PANELS:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        if _draw_panel(ax, panel, runs):
            fig.tight_layout()
            path = out_dir / f"{panel.file}.png"
            fig.savefig(path, dpi=110)
            written.append(path)
            drawn_panels.append(panel)
        plt.close(fig)
    if not drawn_panels:
        raise ValueError(
            f"none of {[d.as_posix() for d in run_dirs]} logged any plotted metric "
            f"({', '.join(k for p in PANELS for k in p.keys)})"
        )
    written.append(_overview(plt, drawn_panels, runs, out_dir))
    return written


def _overview(plt, panels, runs, out_dir: Path) -> Path:
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _draw_panel(ax, panel, runs)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    path = out_dir / "overview.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
