"""``trl-gptoss plot``: PNGs from trainer_state.json log histories, several runs overlaid."""

import json

import pytest

from trl_gptoss.cli import main as cli_main
from trl_gptoss.plotting import PANELS, ema, find_trainer_state, load_log_history, plot_runs
from trl_gptoss.scripts.grpo_summary import summarize


def _write_run(path, rewards, mismatch, checkpoint=None):
    history = [
        {
            "step": i + 1,
            "reward": r,
            "grad_norm": 0.5 + i,
            "entropy": 1.0 - 0.01 * i,
            "kl": 0.0,
            "rollout_corr/kl_k3": m / 10,
            "rollout_corr/abs_logp_diff_max": m,
            "rollout_corr/is_clip_fraction": 0.0,
            "tools/call_frequency": 0.5 + 0.05 * i,
            "policy/ratio_max_abs_dev": 0.0,
        }
        for i, (r, m) in enumerate(zip(rewards, mismatch))
    ]
    for step in (0, len(rewards)):  # held-out evaluations at the start and the end
        history.append({"step": step, "eval_mean@4": 0.1 + step / 20, "eval_pass@4": 0.3 + step / 20})
    history.append({"step": len(rewards), "train_runtime": 1.0, "train_loss": 0.1})  # the end-of-training entry
    target = path / checkpoint if checkpoint else path
    target.mkdir(parents=True)
    (target / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    return path


def test_overlays_runs_and_writes_every_panel(tmp_path):
    good = _write_run(tmp_path / "fa3_sink", [-1, -0.5, 0.0, 0.5] * 3, [1e-5] * 12)
    bad = _write_run(tmp_path / "sinkless", [-1, -1, -0.5, -1] * 3, [0.4] * 12, checkpoint="checkpoint-12")
    paths = plot_runs([good, bad], tmp_path / "plots")
    assert {p.stem for p in paths} == {p.file for p in PANELS} | {"overview"}
    assert all(p.stat().st_size > 2000 for p in paths)


def test_panel_without_data_is_skipped_and_no_data_at_all_is_an_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "reward": 0.5, "loss": 0}]}))
    assert {p.stem for p in plot_runs([run], tmp_path / "p")} == {"reward", "overview"}
    (run / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "loss": 0.0, "epoch": 1}]}))
    with pytest.raises(ValueError, match="none of"):
        plot_runs([run], tmp_path / "q")


def test_newest_checkpoint_state_is_found_and_missing_runs_are_named(tmp_path):
    _write_run(tmp_path / "run", [0.0] * 2, [0.0] * 2, checkpoint="checkpoint-2")
    (tmp_path / "run" / "checkpoint-10").mkdir()
    (tmp_path / "run" / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    assert find_trainer_state(tmp_path / "run").parent.name == "checkpoint-10"  # numeric, not lexicographic
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_log_history(tmp_path / "nope")


def test_cli_plot_and_summary_windows(tmp_path, capsys):
    run = _write_run(tmp_path / "run", [-1.0] * 5 + [1.0] * 5, [1e-6] * 10)
    assert cli_main(["plot", str(run), "--labels", "demo"]) == 0
    assert (run / "plots" / "overview.png").is_file() and "reward.png" in capsys.readouterr().out
    summary = summarize(load_log_history(run))
    assert summary["reward_first_20pct"] == -1.0 and summary["reward_last_20pct"] == 1.0
    assert summary["tool_calls_per_episode_first_20pct"] == pytest.approx(0.525)
    assert summary["max_abs_logp_diff"] == 1e-6 and summary["steps"] == 10


def test_ema_is_bias_corrected():
    assert ema([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
