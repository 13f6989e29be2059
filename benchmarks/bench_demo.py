"""Profile the CPU demo job (``make demo``): wall time, start-up phases, per-step ``timing/*``, peak memory.

Runs the job as ``accelerate launch ... examples/retool_grpo.py`` in its own process group and, every
``--sample_s`` seconds, sums the resident memory of every process descending from it (trainer, vLLM server and
engine core, sandboxes): ``rss`` double-counts pages shared between processes, ``pss`` (from
``/proc/PID/smaps_rollup``) splits them, so ``pss`` is what the job adds to the machine. Each output line of
the job is stamped with its time since launch, which gives the start-up phases (warm-start, server start,
first step). The machine's 1-minute load average is recorded beside every number: on a shared 2-core host
phases must be compared by their share of the step, not only by seconds.

    .venv/bin/python benchmarks/bench_demo.py --json benchmarks/results/demo_cpu.json -- \
        --max_steps 3 --warmstart_steps 20 --output_dir /tmp/demo-prof

Everything after ``--`` is passed to the job (``--config`` defaults to the demo YAML); ``--make`` runs it as
``make demo DEMO_ARGS="..."``, so the virtualenv checks of the Makefile are inside the measured wall.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_ENV = {"OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
# Output lines that mark a start-up phase: (phase, regex). The first match of each is kept.
MARKS = (
    ("warmstart_begin", r"warm-start \(SFT\):\s+0%"),
    ("warmstart_end", r"warm-start \(SFT\):\s+100%"),
    ("server_ready", r"vLLM server .*(ready|healthy|up)"),
    ("first_step_logged", r"'timing/"),
)


def _tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants (by parent pid: the vLLM server runs in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after ')': state ppid pgrp ...
                children.setdefault(int(fields[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _memory_kib(pid: int) -> tuple[int, int]:
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return ""


class MemorySampler(threading.Thread):
    """Peak summed RSS/PSS of a process tree, plus the peak RSS of each process.

    Processes are keyed by pid and named by their last command line: vLLM's engine core and worker start as
    ``multiprocessing.spawn`` children and rename themselves (``VLLM::EngineCore``, ``VLLM::Worker``) once
    their imports are done, so keying by command line would list each of them twice.
    """

    def __init__(self, root: int, every_s: float):
        super().__init__(daemon=True)
        self.root, self.every_s = root, every_s
        self.peak_rss = self.peak_pss = 0
        self.peak_at = 0.0
        self.per_pid: dict[int, tuple[str, int]] = {}  # pid -> (last command line, peak RSS KiB)
        self.at_peak: dict[str, int] = {}  # PSS of every process of the tree when the summed PSS peaked
        self.stop_event = threading.Event()
        self.start_time = time.perf_counter()

    def run(self) -> None:
        while not self.stop_event.is_set():
            total_rss = total_pss = 0
            snapshot = {}
            for pid in _tree_pids(self.root):
                rss, pss = _memory_kib(pid)
                total_rss += rss
                total_pss += pss
                name = _cmdline(pid)
                old_name, old_rss = self.per_pid.get(pid, ("", 0))
                self.per_pid[pid] = (name or old_name, max(rss, old_rss))
                snapshot[f"{pid} {name}"] = pss
            if total_pss > self.peak_pss:
                self.peak_pss, self.peak_at = total_pss, time.perf_counter() - self.start_time
                self.at_peak = snapshot
            self.peak_rss = max(self.peak_rss, total_rss)
            self.stop_event.wait(self.every_s)


def _load() -> float:
    return os.getloadavg()[0]


def _lines(stream):
    """Lines of ``stream`` as they come, split at ``\\n`` and at ``\\r`` (progress bars redraw with ``\\r``)."""
    pending = b""
    while chunk := os.read(stream.fileno(), 65536):
        pending += chunk
        *done, pending = re.split(rb"[\r\n]", pending)
        yield from (d.decode(errors="replace") for d in done if d.strip())
    if pending.strip():
        yield pending.decode(errors="replace")


def job_command(job_args: list[str], via_make: bool) -> list[str]:
    """``make demo DEMO_ARGS=...`` (the user's path: the virtualenv stamps are checked, and rebuilt when stale,
    inside the timed wall) or the ``accelerate launch`` line that target runs."""
    if via_make:
        return ["make", "--no-print-directory", "demo", f"DEMO_ARGS={shlex.join(job_args)}"]
    command = [
        str(REPO / ".venv/bin/accelerate"),
        "launch",
        "--cpu",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "examples/retool_grpo.py",
    ]
    if "--config" not in job_args:
        command += ["--config", "examples/configs/retool_cpu_demo.yaml"]
    return command + job_args


def run_job(command: list[str], sample_s: float, log_path: Path | None) -> dict:
    env = {**os.environ, **DEMO_ENV}
    start = time.perf_counter()
    loads = [_load()]
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    sampler = MemorySampler(proc.pid, sample_s)
    sampler.start()
    marks: dict[str, float] = {}
    log = log_path.open("w") if log_path else None  # noqa: SIM115  (closed in finally, written line by line)
    try:
        for line in _lines(proc.stdout):
            now = time.perf_counter() - start
            for name, pattern in MARKS:
                if name not in marks and re.search(pattern, line):
                    marks[name] = round(now, 1)
            if log:
                log.write(f"{now:8.1f} {line}\n")
                log.flush()
            loads.append(_load())
        returncode = proc.wait()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the job stops as on Ctrl-C (its server with it)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait()
        raise
    finally:
        sampler.stop_event.set()
        sampler.join()
        if log:
            log.close()
    return {
        "command": command,
        "returncode": returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "marks_s": marks,
        "peak_rss_gib": round(sampler.peak_rss / 2**20, 2),
        "peak_pss_gib": round(sampler.peak_pss / 2**20, 2),
        "peak_pss_at_s": round(sampler.peak_at, 1),
        "peak_rss_by_process_mib": {
            f"{pid} {name}": round(rss / 1024) for pid, (name, rss) in sorted(sampler.per_pid.items()) if rss > 50_000
        },
        "pss_at_peak_mib": {k: round(v / 1024) for k, v in sorted(sampler.at_peak.items(), key=lambda kv: -kv[1])},
        "load_1min": {"min": min(loads), "max": max(loads), "mean": round(statistics.fmean(loads), 2)},
    }


def step_breakdown(output_dir: Path) -> dict:
    """Per-step ``timing/*``, step wall (from ``train_runtime`` and the log), reward and tool calls."""
    state = output_dir / "trainer_state.json"
    if not state.is_file():
        return {}
    history = json.loads(state.read_text())["log_history"]
    steps = [h for h in history if "timing/generation" in h]
    keys = sorted({k for h in steps for k in h if k.startswith("timing/")})
    per_step = [{k: round(h.get(k, 0.0), 2) for k in ["step", *keys]} for h in steps]
    for h, row in zip(steps, per_step):
        for key in ("reward", "tools/call_frequency", "completions/mean_length", "step_time"):
            if key in h:
                row[key] = round(h[key], 3)
    final = next((h for h in reversed(history) if "train_runtime" in h), {})
    out = {"steps": per_step, "train_runtime_s": final.get("train_runtime")}
    if per_step:
        means = {k: round(statistics.fmean(r[k] for r in per_step), 2) for k in keys}
        out["mean_timing_s"] = means
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--log", type=Path, help="write the job's time-stamped output here")
    parser.add_argument("--sample_s", type=float, default=0.5)
    parser.add_argument("--label", default="demo")
    parser.add_argument("--make", action="store_true", help="run `make demo DEMO_ARGS=...` (stamps checked)")
    args = parser.parse_args(argv[:split])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    job_args = argv[split + 1 :]
    result = {
        "label": args.label,
        "cores": os.cpu_count(),
        **run_job(job_command(job_args, args.make), args.sample_s, args.log),
    }
    output_dir = job_args[job_args.index("--output_dir") + 1] if "--output_dir" in job_args else None
    if output_dir:
        result.update(step_breakdown(Path(output_dir)))
        stamp = Path(output_dir) / "warmstart" / "warmstart.json"
        if stamp.is_file():
            result["warmstart_train_s"] = round(json.loads(stamp.read_text())["seconds"], 1)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
