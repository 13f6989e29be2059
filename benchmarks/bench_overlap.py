"""Step wall time of the CPU demo job, strictly on-policy (``max_staleness=0``) vs one step off (``=1``).

The vLLM server is pinned to one core and the trainer (with its sandboxes) to another, the shape of the GPU
recipes (rollout GPUs and training GPUs are different devices), so that overlap can help at all on a 2-core
host. Both runs start from one warm-started policy (``--warmstart_dir``, trained once, unpinned, by a first
``--max_steps 1`` run) and train ``--steps`` steps; the step wall time is the time between two consecutive
step log lines (the job's output is time-stamped as it arrives), and the per-phase breakdown comes from the
``timing/*`` metrics in ``trainer_state.json``.

    .venv/bin/python benchmarks/bench_overlap.py --steps 8 --json benchmarks/results/overlap_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pinning import ServerPinner  # noqa: E402

CONFIG = "examples/configs/retool_cpu_demo.yaml"
JOB_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
SKIP_STEPS = 2  # the first steps include start-up effects (and, with max_staleness=1, a foreground generation)


def run_job(output_dir: Path, warmstart_dir: Path, steps: int, staleness: int, pin: bool, log: Path) -> dict:
    """One job run; returns the time-stamped step log lines and the load averages seen."""
    command = [sys.executable, "examples/retool_grpo.py", "--config", CONFIG, "--output_dir", str(output_dir)]
    command += ["--warmstart_dir", str(warmstart_dir), "--max_steps", str(steps), "--save_strategy", "no"]
    command += ["--max_staleness", str(staleness), "--disable_tqdm", "true"]
    threads = "1" if pin else "2"
    env = {**os.environ, **JOB_ENV, "OMP_NUM_THREADS": threads}
    started = time.perf_counter()
    job = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    if pin:
        os.sched_setaffinity(job.pid, {1})  # the trainer and what it spawns from now on (sandboxes, server)
        pinner = ServerPinner(job.pid, core=0)
        pinner.start()
    step_stamps, loads = [], []
    with open(log, "w") as sink:
        for line in job.stdout:
            now = time.perf_counter() - started
            sink.write(f"{now:9.2f} {line}")
            if "'timing/" in line:
                step_stamps.append(now)
                loads.append(os.getloadavg()[0])
    if pin:
        pinner.stop.set()
        if not pinner.pinned:
            raise SystemExit(f"no vLLM server thread was found to pin; see {log}")
    if job.wait():
        raise SystemExit(f"the job failed (exit {job.returncode}); see {log}")
    return {"step_end_s": step_stamps, "load_1min": loads}


def breakdown(output_dir: Path) -> dict:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in history if "timing/generation" in h][SKIP_STEPS:]
    keys = sorted({k for h in steps for k in h if k.startswith("timing/")})
    return {k: round(statistics.fmean(h.get(k, 0.0) for h in steps), 3) for k in keys} | {
        "reward_mean": round(statistics.fmean(h["reward"] for h in steps), 3),
        "rollout/staleness": [h.get("rollout/staleness") for h in steps],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--work_dir", type=Path, default=Path("/tmp/trl-gptoss-bench-overlap"))
    parser.add_argument("--no_pin", action="store_true", help="do not pin server and trainer to separate cores")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    args.work_dir.mkdir(parents=True, exist_ok=True)
    warm = args.work_dir / "warmstart"
    if not (warm / "warmstart.json").is_file():  # train the shared warm-started policy once, unpinned
        run_job(args.work_dir / "prepare", warm, 1, 0, False, args.work_dir / "prepare.log")
    result = {"steps": args.steps, "pinned": pin, "skipped_first_steps": SKIP_STEPS, "runs": {}}
    for staleness in (0, 1):
        out = args.work_dir / f"staleness{staleness}"
        run = run_job(out, warm, args.steps, staleness, pin, args.work_dir / f"staleness{staleness}.log")
        walls = [b - a for a, b in zip(run["step_end_s"], run["step_end_s"][1:])][SKIP_STEPS - 1 :]
        result["runs"][staleness] = {
            "step_wall_median_s": round(statistics.median(walls), 2),
            "step_walls_s": [round(w, 2) for w in walls],
            "mean_timing_s": breakdown(out),
            "load_1min": [round(x, 1) for x in run["load_1min"]],
        }
    sync, overlap = (result["runs"][s]["step_wall_median_s"] for s in (0, 1))
    result["speedup"] = round(sync / overlap, 2)
    print(f"{'max_staleness':>14} {'step wall median (s)':>21} {'load (1 min)':>14}")
    for staleness, run in result["runs"].items():
        loads = run["load_1min"]
        print(f"{staleness:>14} {run['step_wall_median_s']:>21} {min(loads):>6}-{max(loads):<7}")
    print(f"speed-up of the overlap: {result['speedup']}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
