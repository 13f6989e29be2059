"""Sandbox cost: per-call overhead over a bare interpreter, before/after, and throughput of concurrent calls.

Usage: ``python benchmarks/bench_sandbox.py [--calls 40] [--batch 200] [--baseline-tree DIR] [--out ...]``

Workloads (each verified before it is timed: every call must print the expected value):
- overhead: sequential ``print(1)`` calls, all variants interleaved round-robin so load spikes on a shared
  host hit them alike; median / p90 wall time per call. Floors: the same interpreter started bare,
  ``python -I -c`` (runs ``site`` over the host's site-packages, whose ``.pth`` hooks the sandbox never
  sees, so it can be slower than a sandboxed call) and ``python -I -S -c`` (no ``site``: the strict floor;
  sandbox minus this is an upper bound on what isolation costs). ``--baseline-tree DIR`` also times the
  ``PythonSandbox`` of another checkout (e.g. a ``git worktree`` of the previous launcher) in a worker
  process, interleaved with the rest: the before/after comparison.
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


def _time_interleaved(variants: dict, calls: int, worker_timed: dict | None = None) -> dict:
    """Time ``variants`` (name -> zero-argument function returning stdout) round-robin, so load spikes on
    this shared host hit every variant alike; each output is verified. A ``worker_timed`` variant reports its
    own time (``.last_seconds``, measured in its worker process around the call)."""
    worker_timed = {k: v for k, v in (worker_timed or {}).items() if v is not None}
    for run_one in variants.values():
        run_one()  # warm-up: page cache, interpreter probe
    times = {name: [] for name in variants}
    for _ in range(calls):
        for name, run_one in variants.items():
            start = time.perf_counter()
            out = run_one()
            elapsed = time.perf_counter() - start
            times[name].append(worker_timed[name].last_seconds if name in worker_timed else elapsed)
            if out.strip() != "1":
                raise RuntimeError(f"verification failed for {name}: expected '1', got {out!r}")
    return {
        name: {
            "median_ms": 1e3 * statistics.median(t),
            "p90_ms": 1e3 * _percentile(t, 0.9),
            "calls": calls,
        }
        for name, t in times.items()
    }


def _bare(python: str, *flags: str):
    return lambda: subprocess.run([python, *flags, "-c", "print(1)"], capture_output=True, text=True, env={}).stdout


_BASELINE_WORKER = """
import sys, time
from trl_gptoss.tools import PythonSandbox
sandbox = PythonSandbox(isolation="namespaces", python_executable=sys.argv[1])
for line in sys.stdin:
    start = time.perf_counter()
    out = sandbox.run("print(1)").stdout
    print(time.perf_counter() - start, out.strip(), flush=True)
"""


class _BaselineSandbox:
    """The ``PythonSandbox`` of another checkout, in a worker process that times each call itself."""

    def __init__(self, tree: str, python: str):
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BASELINE_WORKER, python],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tree,
        )
        self.last_seconds = None

    def __call__(self) -> str:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        seconds, out = self.proc.stdout.readline().split()
        self.last_seconds = float(seconds)
        return out

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def bench_overhead(calls: int, python: str, baseline_tree: str | None) -> dict:
    """The sandbox's median call against the floors (and the baseline checkout's sandbox, if given)."""
    namespaces = PythonSandbox(python_executable=python)
    variants = {
        "namespaces": lambda: namespaces.run("print(1)").stdout,
        "bare -I": _bare(python, "-I"),
        "bare -I -S": _bare(python, "-I", "-S"),
    }
    baseline = _BaselineSandbox(baseline_tree, python) if baseline_tree else None
    if baseline is not None:
        variants["baseline namespaces"] = baseline
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system:  # the fallback level; as root it needs an interpreter every uid can reach
        process = PythonSandbox(isolation="process", python_executable=system)
        variants["process (system python)"] = lambda: process.run("print(1)").stdout
        variants["bare -I (system python)"] = _bare(system, "-I")
    try:
        timed = _time_interleaved(variants, calls, worker_timed={"baseline namespaces": baseline})
    finally:
        if baseline is not None:
            baseline.close()
    floor, strict = timed["bare -I"]["median_ms"], timed["bare -I -S"]["median_ms"]
    for name, row in timed.items():
        if "bare" in name:
            continue
        if "system" in name:
            row.update(overhead_vs_bare_ms=row["median_ms"] - timed["bare -I (system python)"]["median_ms"])
        else:
            row.update(overhead_vs_bare_ms=row["median_ms"] - floor, overhead_vs_no_site_ms=row["median_ms"] - strict)
    return {"python": python, "system_python": system, "variants": timed}


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
        rows.append({"max_concurrency": n, "calls": batch, "seconds": elapsed, "calls_per_s": batch / elapsed})
    base = rows[0]["seconds"]
    for row in rows:
        row["speedup_vs_first"] = base / row["seconds"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--baseline-tree", default=None, help="checkout whose PythonSandbox is the 'before'")
    parser.add_argument("--skip-concurrency", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sandbox.json"))
    args = parser.parse_args()

    load_before = os.getloadavg()[0]  # the host is shared: record how busy it was
    overhead = bench_overhead(args.calls, sys.executable, args.baseline_tree)
    print(f"{'variant':<26}{'median ms':>11}{'p90 ms':>9}{'over bare -I':>14}{'over bare -I -S':>17}")
    for name, row in overhead["variants"].items():
        extra = f"{row['overhead_vs_bare_ms']:>14.1f}" if "overhead_vs_bare_ms" in row else ""
        extra += f"{row['overhead_vs_no_site_ms']:>17.1f}" if "overhead_vs_no_site_ms" in row else ""
        print(f"{name:<26}{row['median_ms']:>11.1f}{row['p90_ms']:>9.1f}{extra}")
    concurrency = [] if args.skip_concurrency else bench_concurrency(args.batch, args.workers)
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
        "baseline_tree": args.baseline_tree,
        "overhead": overhead,
        "concurrency": concurrency,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
