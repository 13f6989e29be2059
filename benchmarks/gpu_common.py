"""What the GPU check kit's benchmarks share: device, deadline, timing, peak memory, tables and the JSON record.

Each kit benchmark (``bench_triton_attention.py``, ``bench_gpu_layer.py``, ``bench_gpu_experts.py``,
``bench_gpu_logprobs.py``) runs one code path in two modes: on a CUDA GPU at GPT-OSS sizes, and with
``--dry-run`` on the CPU at tiny sizes (Triton under ``TRITON_INTERPRET=1``), so the CPU suite runs every
part's logic and JSON between the rare GPU lends. Every benchmark verifies its numbers before timing them
(STYLE.md 7), never raises out of ``main`` (a failure is recorded in its JSON with ``status: fail``; a failed
verification or case stops only what depends on it: ``Bench.attempt``) and checks its own deadline
(``--budget-s``) before each case: a case that would not finish is listed as skipped with the reason, never
half-run.

The record every benchmark writes (``Bench.write``): ``{"part", "status": pass|fail|skip, "reason",
"dry_run", "environment", "elapsed_s", "rows", "skipped", "checks", "goals", "table_md", ...}``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
FAILED = object()  # what ``Bench.attempt`` returns for a call that raised


def parser(description: str, default_budget_s: float) -> argparse.ArgumentParser:
    """The flags every kit benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", help="JSON file to write (default: benchmarks/results/<part>_gpu.json)")
    p.add_argument("--budget-s", type=float, default=default_budget_s, help="this part's own time cap, seconds")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreted: the logic only")
    return p


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """Versions and the device: the first thing to read when comparing two runs."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "flash_attn_4": _version("flash-attn-4"),
        "nvidia_cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            device=props.name,
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / GIB, 1),
        )
    else:
        env.update(device=f"cpu ({platform.machine()})", threads=torch.get_num_threads())
    return env


class Bench:
    """One part's run: device, deadline, rows, skipped cases, checks and goals, written once as JSON."""

    def __init__(self, part: str, args: argparse.Namespace):
        self.part, self.dry_run = part, args.dry_run
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"{part}_gpu.json"
        self.device = "cpu" if args.dry_run else "cuda"
        self.rows: list[dict] = []
        self.skipped: list[dict] = []
        self.checks: list[dict] = []
        self.goals: list[dict] = []
        self.extra: dict = {}
        self.failures: list[str] = []
        self.status, self.reason = "pass", ""

    # ------------------------------------------------------------------ budget
    def left(self) -> float:
        return self.deadline - time.monotonic()

    def skip(self, case: dict, reason: str) -> None:
        self.skipped.append({**case, "reason": reason})
        print(f"skip {case}: {reason}", flush=True)

    def attempt(self, case: dict, fn, *args) -> object:
        """``fn(*args)``, or ``FAILED`` after recording the failure as a skipped case: one broken verification,
        compile or out-of-memory does not stop the part's other cases (the part still ends ``fail``)."""
        try:
            return fn(*args)
        except Exception as error:
            traceback.print_exc()
            self.failures.append(f"{case}: {type(error).__name__}: {str(error)[:300]}")
            self.skip(case, f"failed: {type(error).__name__}: {str(error)[:300]}")
            if self.device == "cuda":
                torch.cuda.empty_cache()
            return FAILED

    def fits_time(self, estimate_s: float) -> str | None:
        """None when ``estimate_s`` fits the part's remaining budget, else the reason to skip."""
        left = self.left()
        return None if estimate_s <= left else f"time cap: needs ~{estimate_s:.0f} s, {max(left, 0):.0f} s left"

    def fits_memory(self, need_bytes: float) -> str | None:
        """None when ``need_bytes`` fits 90% of the device's free memory, else the reason to skip."""
        free = free_bytes(self.device)
        if need_bytes <= 0.9 * free:
            return None
        return f"does not fit: needs ~{need_bytes / GIB:.1f} GiB, {free / GIB:.1f} GiB free"

    # ------------------------------------------------------------------ measuring
    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn, target_ms: float = 200.0, max_reps: int = 30) -> dict:
        """Warm-up call (compiles), one estimate call, then as many calls as fill ``target_ms`` (1..max_reps).
        Returns median/min milliseconds, the rep count and the warm-up (compile) time. A dry run stops after
        the estimate call: its times mean nothing, its code path is what is checked."""
        warm = self._elapsed_ms(fn)
        first = self._elapsed_ms(fn)
        reps = 1 if self.dry_run else max(1, min(max_reps, int(target_ms / max(first, 1e-3))))
        times = [first] if reps == 1 else [self._elapsed_ms(fn) for _ in range(reps)]
        return {"ms": statistics.median(times), "min_ms": min(times), "reps": len(times), "warmup_ms": warm}

    def _elapsed_ms(self, fn) -> float:
        if self.device != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)

    def peak_bytes(self, fn) -> tuple[object, int | None]:
        """``(fn(), peak bytes allocated above what was allocated before)``; on the CPU ``(None, None)`` and
        ``fn`` is not run (the CUDA allocator's statistics are what is measured; ``time_ms`` ran ``fn``)."""
        if self.device != "cuda":
            return None, None
        self.sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        self.sync()
        return result, torch.cuda.max_memory_allocated() - base

    # ------------------------------------------------------------------ recording
    def check(self, name: str, error: float, tolerance: float, **detail) -> None:
        """Record a correctness check; raises ``AssertionError`` (caught by ``run``) when it fails."""
        ok = bool(error <= tolerance)
        self.checks.append({"name": name, "error": error, "tolerance": tolerance, "ok": ok, **detail})
        print(f"check {name}: {error:.3e} <= {tolerance:.3e} {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            raise AssertionError(f"{name}: error {error:.3e} > tolerance {tolerance:.3e}")

    def goal(self, name: str, value: float | None, target: str, met: bool | None) -> None:
        """Record a goal of the issue; a dry run's tiny CPU numbers judge nothing (``met: None``)."""
        self.goals.append({"name": name, "value": value, "target": target, "met": None if self.dry_run else met})

    def run(self, body) -> int:
        """Run ``body(self)``; record any exception as a failure; write the JSON; return the exit status."""
        if not self.dry_run and not torch.cuda.is_available():
            self.status, self.reason = "skip", "no CUDA device (use --dry-run for the CPU logic check)"
        else:
            try:
                body(self)
            except Exception as error:  # a part never dies without its JSON
                traceback.print_exc()
                self.status, self.reason = "fail", f"{type(error).__name__}: {error}"
        if self.status == "pass" and self.failures:
            self.status, self.reason = "fail", "; ".join(self.failures)[:2000]
        if self.status == "pass" and not self.rows:
            self.status = "skip"
            self.reason = self.reason or "no case ran: " + "; ".join(sorted({s["reason"] for s in self.skipped}))
        self.write()
        return 0 if self.status != "fail" else 1

    def write(self) -> None:
        table = self.table_md()
        record = {
            "part": self.part,
            "status": self.status,
            "reason": self.reason,
            "dry_run": self.dry_run,
            "environment": environment(),
            "elapsed_s": round(time.monotonic() - self.started, 2),
            "rows": self.rows,
            "skipped": self.skipped,
            "checks": self.checks,
            "goals": self.goals,
            **self.extra,
            "table_md": table,
        }
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(table)
        print(f"{self.part}: {self.status} {self.reason} -> {self.out}", flush=True)

    columns: tuple[tuple[str, str, str], ...] = ()  # (key, header, format) set per benchmark

    def table_md(self) -> str:
        if not self.rows:
            return ""
        lines = ["| " + " | ".join(h for _, h, _ in self.columns) + " |", "|---" * len(self.columns) + "|"]
        for row in self.rows:
            lines.append("| " + " | ".join(_fmt(row.get(key), fmt) for key, _, fmt in self.columns) + " |")
        return "\n".join(lines)


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "—"
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value)


def free_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable"):
            return int(line.split()[1]) * 1024
    return 0


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual - expected| / max(max|expected|, 1e-6)`` in float64."""
    expected = expected.double()
    scale = max(expected.abs().max().item(), 1e-6)
    return (actual.double() - expected).abs().max().item() / scale
