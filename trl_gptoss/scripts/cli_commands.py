"""The ``plot``, ``grpo`` and ``demo`` subcommands of the ``trl-gptoss`` console script.

``trl-gptoss plot RUN_DIR [RUN_DIR ...]``: training curves of one or more runs, overlaid (PNG files).
``trl-gptoss grpo --config x.yaml [--field value ...]``: the main job (same as ``examples/retool_grpo.py``).
``trl-gptoss demo [--seed N] [--output_dir D]``: the CPU embedded default (what ``make demo`` runs).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _cmd_plot(args) -> int:
    from trl_gptoss.plotting import plot_runs

    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "plots"
    for path in plot_runs(args.run_dirs, out, labels=args.labels):
        print(path)
    return 0


def _cmd_grpo(args) -> int:
    from trl_gptoss.scripts.grpo import main

    main(args.rest)
    return 0


def _cmd_demo(args) -> int:
    from trl_gptoss.demo.paths import embedded_default_config
    from trl_gptoss.scripts.grpo import main

    main(["--config", str(embedded_default_config()), *args.rest])
    return 0


def register(sub) -> None:
    """Add ``plot``, ``grpo`` and ``demo`` to the console script's subparsers."""
    plot = sub.add_parser("plot", help="plot reward, grad norm, entropy, KL, mismatch, IS clip, tool calls")
    plot.add_argument(
        "run_dirs",
        nargs="+",
        help="output_dir of each run (trainer_state.json inside or in a checkpoint-* subdirectory)",
    )
    plot.add_argument("--out", help="where the PNGs go (default: RUN_DIR/plots of the first run)")
    plot.add_argument("--labels", nargs="+", help="legend label per run (default: directory names)")
    plot.set_defaults(func=_cmd_plot)
    grpo = sub.add_parser("grpo", help="GRPO training: --config x.yaml plus --field value overrides", add_help=False)
    grpo.add_argument("rest", nargs=argparse.REMAINDER)
    grpo.set_defaults(func=_cmd_grpo)
    demo = sub.add_parser("demo", help="the CPU embedded default (tiny GPT-OSS, synthetic ReTool task)", add_help=False)
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_cmd_demo)
