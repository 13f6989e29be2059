"""Sandbox cost: per-call overhead over a bare interpreter, before/after, and throughput of concurrent calls.

Usage: ``python benchmarks/bench_sandbox.py [--calls 40] [--batch 200] [--baseline-tree DIR] [--out ...]``

Workloads (each verified before it is timed: every call must print the expected value):
- overhead: sequential ``print(1)`` calls, all variants interleaved round-robin so load spikes on a shared
  host hit them alike; median / p90 wall time per call. The sandbox twice: ``namespaces`` (the default
  ``PythonSandbox``: a fork of its zygote per call, where the host supports one) and ``namespaces (bwrap per
  call)`` (``zygote=False``: a bubblewrap and an interpreter per call). Floors: the same interpreter started bare,
  ``python -I -c`` (runs ``site`` over the host's site-packages, whose ``.pth`` hooks the sandbox never
  sees, so it can be slower than a sandboxed call) and ``python -I -S -c`` (no ``site``: the strict floor;
  sandbox minus this is an upper bound on what isolation costs; ``ratio_vs_no_site`` is sandbox / this floor).
  ``--baseline-tree DIR`` also times the
  ``PythonSandbox`` of another checkout (e.g. a ``git worktree`` of the previous launcher) in a worker
  process, interleaved with the rest: the before/after comparison.
- numpy: ``import numpy; print(1)`` through both launchers, interleaved (the zygote has numpy imported).
- concurrency: ``run_many`` of ``--batch`` calls that each sleep 50 ms, for several ``max_concurrency``, through
  both launchers; reports calls/s and speed-up over the first ``max_concurrency`` of the same launcher.
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


def _time_interleaved(variants: dict, calls: int, worker_timed: dict | None = None, expect: str = "1") -> dict:
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
            if out.strip() != expect:
                raise RuntimeError(f"verification failed for {name}: expected {expect!r}, got {out!r}")
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
    per_call = PythonSandbox(python_executable=python, zygote=False)
    variants = {
        "namespaces": lambda: namespaces.run("print(1)").stdout,
        "namespaces (bwrap per call)": lambda: per_call.run("print(1)").stdout,
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
            row.update(ratio_vs_no_site=row["median_ms"] / strict)
    namespaces.close()
    per_call.close()
    return {"python": python, "system_python": system, "zygote": namespaces.zygote, "variants": timed}


def bench_numpy(calls: int, python: str) -> dict:
    """``import numpy`` in a call: preloaded in the zygote, imported from scratch by a per-call interpreter."""
    code = "import numpy\nprint(1)"
    zygote = PythonSandbox(python_executable=python)
    per_call = PythonSandbox(python_executable=python, zygote=False)
    variants = {
        "namespaces": lambda: zygote.run(code).stdout,
        "namespaces (bwrap per call)": lambda: per_call.run(code).stdout,
        "bare -I": lambda: (
            subprocess.run(  # -S would leave the venv's numpy off sys.path
                [python, "-I", "-c", code], capture_output=True, text=True, env={"OMP_NUM_THREADS": "1"}
            ).stdout
        ),
    }
    timed = _time_interleaved(variants, calls)
    zygote.close()
    per_call.close()
    return {"code": code, "zygote": zygote.zygote, "variants": timed}


def bench_concurrency(batch: int, workers: list[int]) -> list[dict]:
    codes = [f"import time\ntime.sleep(0.05)\nprint({i})" for i in range(batch)]
    rows = []
    for n in workers:
        for zygote in (None, False):  # interleaved: the default (zygote where supported), a bubblewrap per call
            sandbox = PythonSandbox(SandboxLimits(wall_seconds=30), max_concurrency=n, zygote=zygote)
            sandbox.run("print(1)")  # the zygote starts on its first call: not part of the batch
            start = time.perf_counter()
            results = sandbox.run_many(codes)
            elapsed = time.perf_counter() - start
            sandbox.close()
            if [r.stdout for r in results] != [f"{i}\n" for i in range(batch)] or not all(r.ok for r in results):
                raise RuntimeError(f"verification failed at max_concurrency={n}")
            launcher = "zygote" if sandbox.zygote else "bwrap per call"
            rows.append(
                {"launcher": launcher, "max_concurrency": n, "calls": batch, "seconds": elapsed,
                 "calls_per_s": batch / elapsed}
            )  # fmt: skip
    for launcher in {row["launcher"] for row in rows}:
        own = [row for row in rows if row["launcher"] == launcher]
        for row in own:
            row["speedup_vs_first"] = own[0]["seconds"] / row["seconds"]
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
    print(f"zygote: {overhead['zygote']}")
    header = f"{'variant':<30}{'median ms':>11}{'p90 ms':>9}{'over bare -I':>14}{'over bare -I -S':>17}"
    print(header + f"{'/ bare -I -S':>14}")
    for name, row in overhead["variants"].items():
        extra = f"{row['overhead_vs_bare_ms']:>14.1f}" if "overhead_vs_bare_ms" in row else ""
        extra += f"{row['overhead_vs_no_site_ms']:>17.1f}" if "overhead_vs_no_site_ms" in row else ""
        extra += f"{row['ratio_vs_no_site']:>14.2f}" if "ratio_vs_no_site" in row else ""
        print(f"{name:<30}{row['median_ms']:>11.1f}{row['p90_ms']:>9.1f}{extra}")
    numpy_rows = bench_numpy(max(args.calls // 2, 5), sys.executable)
    print(f"\n{numpy_rows['code']!r}")
    for name, row in numpy_rows["variants"].items():
        print(f"{name:<30}{row['median_ms']:>11.1f}{row['p90_ms']:>9.1f}")
    concurrency = [] if args.skip_concurrency else bench_concurrency(args.batch, args.workers)
    print(f"\n{'launcher':<16}{'workers':<9}{'calls':>6}{'seconds':>9}{'calls/s':>9}{'speed-up':>10}")
    for row in concurrency:
        print(
            f"{row['launcher']:<16}{row['max_concurrency']:<9}{row['calls']:>6}{row['seconds']:>9.2f}"
            f"{row['calls_per_s']:>9.1f}{row['speedup_vs_first']:>10.2f}"
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
        "numpy": numpy_rows,
        "concurrency": concurrency,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
