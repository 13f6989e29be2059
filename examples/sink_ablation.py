"""The retrospective's finding at small scale: train with exact sink attention and with a sink-less one.

Both runs start from the same warm-started policy and sample from the same sink-aware engine (vLLM); only
the attention the trainer computes log-probs and gradients with differs: ``fa3_sink`` (sinks honoured, the
engine's distribution) or ``sinkless`` (sinks silently dropped, what flash-attention 2/3 training did).
Reward, gradient norm and max |log p_train - log p_rollout| of both runs are overlaid in OUT/plots:

    python examples/sink_ablation.py --config examples/configs/retool_cpu_demo.yaml \
        --output_dir runs/sink-ablation

Any other ``--field value`` is passed to both runs. Results measured on a 2-core CPU: docs/quickstart.md.
"""

import sys
from pathlib import Path

from trl_gptoss.plotting import plot_runs
from trl_gptoss.scripts.grpo import end_distributed, parse_job_args, run

ATTENTIONS = ("fa3_sink", "sinkless")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    job, training = parse_job_args(argv)  # checks the config once, before either run
    root = Path(training.output_dir)
    summaries = {}
    for attention in ATTENTIONS:
        job, training = parse_job_args(
            argv
            + [
                "--attn_implementation",
                attention,
                "--output_dir",
                str(root / attention),
                "--warmstart_dir",
                str(root / "warmstart"),
            ]
        )
        summaries[attention] = run(job, training)
    end_distributed()
    paths = plot_runs([root / a for a in ATTENTIONS], root / "plots", labels=list(ATTENTIONS))
    print(f"\noverlaid curves: {root / 'plots'} ({len(paths)} files)")
    for attention, summary in summaries.items():
        print(
            f"{attention:>9}: reward {summary.get('reward_first_20pct', float('nan')):+.3f} -> "
            f"{summary.get('reward_last_20pct', float('nan')):+.3f}, "
            f"max |dlogp| {summary.get('max_abs_logp_diff', float('nan')):.2e}"
        )
    return summaries


if __name__ == "__main__":
    main()
