"""Sandbox cost: per-call overhead by isolation level, and throughput of concurrent calls.

Usage: ``python benchmarks/bench_sandbox.py [--calls 40] [--batch 200] [--out results/sandbox.json]``

Workloads (each verified before it is timed: every call must print the expected value):
- overhead: sequential ``print(1)`` calls, the variants interleaved round-robin; median / p90 wall time
  per call for ``process`` and ``namespaces`` isolation, and for the same interpreter started bare
  (``subprocess.run([python, -I, -c, ...])``, no isolation: the floor). Overhead = sandbox - bare median.
- concurrency: ``run_many`` of ``--batch`` calls that each sleep 50 ms, for several ``max_concurrency``;
  reports calls/s and speed-up over ``max_concurrency=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

from trl_gptoss.tools import PythonSandbox, SandboxLimits, detect_isolation


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time_interleaved(variants: dict, calls: int) -> dict:
    """Time ``variants`` (name -> zero-argument function returning stdout) round-robin, so load spikes on
    this shared host hit every variant alike; each output is verified."""
    for run_one in variants.values():
        run_one()  # warm-up: page cache, interpreter probe
    times = {name: [] for name in variants}
    for _ in range(calls):
        for name, run_one in variants.items():
            start = time.perf_counter()
            out = run_one()
            times[name].append(time.perf_counter() - start)
            if out.strip() != "1":
                raise RuntimeError(f"verification failed for {name}: expected '1', got {out!r}")
    return {
        name: {"median_ms": 1e3 * statistics.median(t), "p90_ms": 1e3 * _percentile(t, 0.9), "calls": calls}
        for name, t in times.items()
    }


def _bare(python: str):
    return lambda: (
        subprocess.run([python, "-I", "-c", "print(1)"], capture_output=True, text=True, env={}).stdout
    )


def bench_overhead(calls: int, python: str) -> dict:
    """Per level: the sandbox's median call, and the same interpreter started bare (the floor)."""
    levels = ["process"] + (["namespaces"] if detect_isolation() == "namespaces" else [])
    # As root, process isolation drops to a per-call uid that needs a world-readable interpreter.
    exes = {
        level: shutil.which("python3", path="/usr/bin:/bin")
        if level == "process" and os.geteuid() == 0
        else python
        for level in levels
    }
    variants = {}
    for level in levels:
        sandbox = PythonSandbox(isolation=level, python_executable=exes[level])
        variants[level] = lambda sb=sandbox: sb.run("print(1)").stdout
        variants[f"bare:{level}"] = _bare(exes[level])
    timed = _time_interleaved(variants, calls)
    rows = {}
    for level in levels:
        row, bare = timed[level], timed[f"bare:{level}"]
        row.update(
            python=exes[level],
            bare_median_ms=bare["median_ms"],
            overhead_ms=row["median_ms"] - bare["median_ms"],
        )
        rows[level] = row
    return rows


def bench_concurrency(batch: int, workers: list[int]) -> list[dict]:
    codes = [f"import time\ntime.sleep(0.05)\nprint({i})" for i in range(batch)]
    rows = []
    for n in workers:
        sandbox = PythonSandbox(SandboxLimits(wall_seconds=30), max_concurrency=n)
        start = time.perf_counter()
        results = sandbox.run_many(codes)
        elapsed = time.perf_counter() - start
        if [r.stdout for r in results] != [f"{i}\n" for i in range(batch)] or not all(r.ok for r in results):
            raise RuntimeError(f"verification failed at max_concurrency={n}")
        rows.append(
            {"max_concurrency": n, "calls": batch, "seconds": elapsed, "calls_per_s": batch / elapsed}
        )
    base = rows[0]["seconds"]
    for row in rows:
        row["speedup_vs_first"] = base / row["seconds"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sandbox.json"))
    args = parser.parse_args()

    load_before = os.getloadavg()[0]  # the host is shared: record how busy it was
    overhead = bench_overhead(args.calls, sys.executable)
    print(f"{'isolation':<12}{'median ms':>11}{'p90 ms':>9}{'bare ms':>9}{'overhead ms':>13}  python")
    for level, row in overhead.items():
        print(
            f"{level:<12}{row['median_ms']:>11.1f}{row['p90_ms']:>9.1f}{row['bare_median_ms']:>9.1f}"
            f"{row['overhead_ms']:>13.1f}  {row['python']}"
        )
    concurrency = bench_concurrency(args.batch, args.workers)
    print(f"\n{'workers':<9}{'calls':>6}{'seconds':>9}{'calls/s':>9}{'speed-up':>10}")
    for row in concurrency:
        print(
            f"{row['max_concurrency']:<9}{row['calls']:>6}{row['seconds']:>9.2f}{row['calls_per_s']:>9.1f}"
            f"{row['speedup_vs_first']:>10.2f}"
        )
    record = {
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "isolation": detect_isolation(),
            "euid": os.geteuid(),
            "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
        },
        "limits": SandboxLimits().__dict__,
        "overhead": overhead,
        "concurrency": concurrency,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
