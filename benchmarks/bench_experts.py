"""Peak memory and time of GPT-OSS experts implementations: eval forward and train forward+backward.

Compares ``gptoss_sequential`` (``gptoss_kernels.experts`` through ``trl_gptoss``'s ``ExpertsInterface``
registration) with upstream transformers ``eager`` (per-expert loop over a one-hot mask), ``grouped_mm`` (the
default) and ``batched_mm``, and with ``loop``: the plain per-expert loop one would write by hand
(``torch.where`` on the ids, gather, two matmuls, ``index_add_``), the eval-memory yardstick. Every case runs
in a fresh subprocess (so peak RSS is its own) with one thread, checks its output (and, for train, d_hidden) on
a 64-token prefix against a float64 reference before timing, then measures:

- peak: VmHWM - VmRSS around the first measured call (``/proc/self/clear_refs`` resets the high-water mark;
  ``MALLOC_MMAP_THRESHOLD_`` is pinned so freed tensors leave RSS), includes weight gradients in train mode
  (``set_to_none`` before each call) and the growth of oneDNN's per-shape caches; ``peak_warm_mib`` is the
  smallest of the later calls' (caches warm; the least disturbed by heap reuse, as the time is the fastest),
  when the case is fast enough to run more than once;
- time: the fastest of up to 3 calls, wall and CPU seconds (the minimum is the estimate least disturbed by
  other jobs on a shared machine; the median wall time is kept in the JSON).

Usage: ``python benchmarks/bench_experts.py [--quick] [--suite all|precisions] [--only eval:16384]
[--precision fp32_autocast_bf16] [--out PATH]``. ``--suite precisions`` holds the eval-memory promise: the
sequential op's peak over the hand-written loop's (``peak_vs_loop``, <= 1) in fp32, bf16 and fp32 weights
under bf16 autocast.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

PREFIX_TOKENS = 64


class Precision(NamedTuple):
    """One precision setup: the parameters' and hidden states' dtype, the routing weights' dtype (the router's
    softmax output), the autocast dtype the call runs under (None: no autocast), the verification tolerance."""

    weights: torch.dtype
    routing: torch.dtype
    autocast: torch.dtype | None
    tolerance: float


# The three setups a recipe can give the experts: fp32 throughout, bf16 weights, fp32 weights under bf16
# autocast (`dtype: float32` + `bf16: true`, where the router's softmax output arrives in bf16).
PRECISIONS = {
    "fp32": Precision(torch.float32, torch.float32, None, 1e-4),
    "bf16": Precision(torch.bfloat16, torch.bfloat16, None, 3e-2),
    "fp32_autocast_bf16": Precision(torch.float32, torch.bfloat16, torch.bfloat16, 3e-2),
}


def _precision_context(case):
    """The autocast region the case's calls run in (a no-op context without autocast)."""
    autocast = PRECISIONS[case["dtype"]].autocast
    return contextlib.nullcontext() if autocast is None else torch.autocast("cpu", dtype=autocast)


def _case(impl, mode, tokens, hidden=512, inter=512, experts=32, top_k=4, dtype="fp32"):
    return dict(
        impl=impl, mode=mode, tokens=tokens, hidden=hidden, inter=inter, experts=experts, top_k=top_k, dtype=dtype
    )


def all_cases(quick: bool) -> list[dict]:
    """H = I = 512, E = 32, top-4 at 1k/4k/16k (batched_mm only at 256: ~12 MiB per token), and one
    GPT-OSS-20b-width layer (H = I = 2880, E = 32, top-4, bf16) at 1k tokens. The hand-written ``loop`` is
    the eval yardstick only (its train step is upstream eager's autograd story again)."""
    impls = {
        "eval": ["gptoss_sequential", "loop", "eager", "grouped_mm"],
        "train": ["gptoss_sequential", "eager", "grouped_mm"],
    }
    token_counts = [1024] if quick else [1024, 4096, 16384]
    sizes = [dict(tokens=256)] + [dict(tokens=t) for t in token_counts]
    if not quick:
        sizes.append(dict(tokens=1024, hidden=2880, inter=2880, dtype="bf16"))
    cases = []
    for size in sizes:
        for mode in ("eval", "train"):
            extra = ["batched_mm"] if size["tokens"] == 256 else []
            cases += [_case(impl, mode, **size) for impl in impls[mode] + extra]
    return cases


def precision_cases(quick: bool) -> list[dict]:
    """The eval-memory promise in every precision setup: ``gptoss_sequential`` and the hand-written ``loop``,
    eval, H = I = 512, E = 32, top-4, at 1k/4k/16k tokens (16k only with ``--quick``) in each of
    ``PRECISIONS``."""
    token_counts = [16384] if quick else [1024, 4096, 16384]
    return [
        _case(impl, "eval", tokens, dtype=precision)
        for precision in PRECISIONS
        for tokens in token_counts
        for impl in ("gptoss_sequential", "loop")
    ]


# ----------------------------------------------------------------------------------------------- worker side
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Return freed memory to the OS, reset the RSS high-water mark, return the current RSS in KiB."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def plain_loop(module, hidden, index, weights):
    """The per-expert loop one writes by hand: no one-hot mask, upstream's gate math."""
    out = torch.zeros_like(hidden)
    for expert in index.unique().tolist():
        token, slot = torch.where(index == expert)
        gate_up = hidden[token] @ module.gate_up_proj[expert] + module.gate_up_proj_bias[expert]
        y = module._apply_gate(gate_up) @ module.down_proj[expert] + module.down_proj_bias[expert]
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def _build(case):
    import functools

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    import trl_gptoss  # noqa: F401  (registers gptoss_sequential once transformers' GPT-OSS modeling loads)
    from trl_gptoss.testing import tiny_gpt_oss_config

    precision = PRECISIONS[case["dtype"]]
    dtype = precision.weights
    config = tiny_gpt_oss_config(
        hidden_size=case["hidden"],
        intermediate_size=case["inter"],
        num_local_experts=case["experts"],
        num_experts_per_tok=case["top_k"],
    )
    config._experts_implementation = "eager" if case["impl"] == "loop" else case["impl"]
    generator = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        module = GptOssExperts(config)
    module = module.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for param in module.parameters():
            fan_in = param.shape[-2] if param.dim() == 3 else 1
            param.copy_(
                torch.randn(param.shape, generator=generator, dtype=dtype) * (0.02 if fan_in == 1 else fan_in**-0.5)
            )
    tokens = case["tokens"]
    hidden = torch.randn(tokens, case["hidden"], generator=generator, dtype=dtype)
    logits = torch.randn(tokens, case["experts"], generator=generator)
    top_values, index = logits.topk(case["top_k"], dim=-1)
    run = functools.partial(plain_loop, module) if case["impl"] == "loop" else module
    return module, run, hidden, index, top_values.softmax(-1).to(precision.routing)


def _reference(module, hidden, index, weights):
    """float64 per-pair math over the experts hit by ``hidden``'s tokens (casts one expert at a time)."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for expert in index.unique().tolist():
        token, slot = (index == expert).nonzero(as_tuple=True)
        gate_up = hidden[token].double() @ module.gate_up_proj[expert].double() + module.gate_up_proj_bias[expert]
        gate = gate_up[:, 0::2].clamp(max=module.limit)
        up = gate_up[:, 1::2].clamp(-module.limit, module.limit)
        act = (up + 1) * gate * torch.sigmoid(module.alpha * gate)
        y = act @ module.down_proj[expert].double() + module.down_proj_bias[expert].double()
        out.index_add_(0, token, y * weights[token, slot, None].double())
    return out


def _verify(case, module, run, hidden, index, weights):
    """Check output (and d_hidden for train) on a prefix against float64; raise if outside tolerance."""
    dtype, tolerance = hidden.dtype, PRECISIONS[case["dtype"]].tolerance
    h, i, w = hidden[:PREFIX_TOKENS], index[:PREFIX_TOKENS], weights[:PREFIX_TOKENS]
    h64 = h.double().requires_grad_(True)
    ref = _reference(module, h64, i, w)
    cotangent = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    checks = [("out", lambda: run(h, i, w), lambda: ref.detach())]
    if case["mode"] == "train":
        (ref_grad,) = torch.autograd.grad((ref * cotangent).sum(), h64)
        hg = h.detach().requires_grad_(True)
        checks.append(
            (
                "d_hidden",
                lambda: torch.autograd.grad((run(hg, i, w) * cotangent.to(dtype)).sum(), hg)[0],
                lambda: ref_grad,
            )
        )
    errors = {}
    for name, actual_fn, expected_fn in checks:
        with torch.set_grad_enabled(name != "out"), _precision_context(case):
            actual = actual_fn().double()
        expected = expected_fn()
        errors[name] = ((actual - expected).abs().max() / expected.abs().max()).item()
        if errors[name] > tolerance:
            raise AssertionError(f"{case['impl']} {name}: relative error {errors[name]:.2e} > {tolerance}")
    return errors


def _step(case, run, hidden, index, weights):
    if case["mode"] == "eval":
        with torch.no_grad(), _precision_context(case):
            run(hidden, index, weights)
        return
    h, w = hidden.detach().requires_grad_(True), weights.detach().requires_grad_(True)
    with _precision_context(case):
        loss = run(h, index, w).float().square().mean()
    loss.backward()


def run_worker(case: dict) -> dict:
    torch.set_num_threads(1)
    module, run, hidden, index, weights = _build(case)
    errors = _verify(case, module, run, hidden, index, weights)
    module.zero_grad(set_to_none=True)
    walls, cpus, peaks = [], [], []
    while len(walls) < 3 and sum(walls) < 20:
        module.zero_grad(set_to_none=True)  # before the reset, so every call's peak includes its weight grads
        baseline = _reset_peak()
        wall, cpu = time.perf_counter(), time.process_time()
        _step(case, run, hidden, index, weights)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        peaks.append(round((_status_kib("VmHWM") - baseline) / 1024, 1))
    return {
        **case,
        "verified_rel_err": errors,
        "peak_mib": peaks[0],
        "peak_warm_mib": min(peaks[1:], default=None),
        "wall_s": round(min(walls), 4),
        "cpu_s": round(min(cpus), 4),
        "wall_s_median": round(statistics.median(walls), 4),
        "reps": len(walls),
    }


# ----------------------------------------------------------------------------------------------- driver side
def run_case(case: dict, timeout: float) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(case)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:  # one slow case must not lose the others' results
        return {**case, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {**case, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else f"rc {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratios(results):
    """Add ``peak_vs_sequential`` and ``time_vs_sequential`` (CPU seconds: robust to a shared machine), and
    on the sequential eval rows ``peak_vs_loop``: its peak over the hand-written loop's (the promise: <= 1)."""
    key = lambda r: (r["mode"], r["tokens"], r["hidden"], r["dtype"])
    ok = [r for r in results if "error" not in r]
    ours = {key(r): r for r in ok if r["impl"] == "gptoss_sequential"}
    loops = {key(r): r for r in ok if r["impl"] == "loop"}
    for r in ok:
        base = ours.get(key(r))
        if base:
            r["peak_vs_sequential"] = round(r["peak_mib"] / max(base["peak_mib"], 0.1), 2)
            r["time_vs_sequential"] = round(r["cpu_s"] / base["cpu_s"], 2)
        loop = loops.get(key(r))
        if loop and r["impl"] == "gptoss_sequential":
            r["peak_vs_loop"] = round(r["peak_mib"] / max(loop["peak_mib"], 0.1), 2)
            if r["peak_warm_mib"] is not None and loop["peak_warm_mib"] is not None:
                r["peak_warm_vs_loop"] = round(r["peak_warm_mib"] / max(loop["peak_warm_mib"], 0.1), 2)


def print_table(results):
    header = (
        "| mode | T | H=I | precision | impl | peak MiB | peak MiB warm | wall s | cpu s | peak / seq | time / seq "
        "| peak / loop | warm peak / loop |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | {r['tokens']} | {r['hidden']} | {r['dtype']} | {r['impl']} | error: {r['error']} |")
            continue
        warm = r["peak_warm_mib"] if r["peak_warm_mib"] is not None else "—"
        print(
            f"| {r['mode']} | {r['tokens']} | {r['hidden']} | {r['dtype']} | {r['impl']} | {r['peak_mib']} | "
            f"{warm} | {r['wall_s']} | {r['cpu_s']} | {r.get('peak_vs_sequential', '')} | "
            f"{r.get('time_vs_sequential', '')} | {r.get('peak_vs_loop', '')} | {r.get('peak_warm_vs_loop', '')} |"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T=256 and 1k only, no 20b-width layer")
    parser.add_argument(
        "--suite",
        choices=("all", "precisions"),
        default="all",
        help="all: every implementation (fp32, one bf16 20b-width layer); precisions: sequential vs the "
        "hand-written loop, eval, in fp32, bf16 and fp32 weights under bf16 autocast",
    )
    parser.add_argument(
        "--out",
        help="JSON path (default: benchmarks/results/experts_cpu.json, experts_precisions_cpu.json for "
        "--suite precisions)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--only", help="MODE:TOKENS, e.g. eval:16384: only those cases (JSON not written)")
    parser.add_argument(
        "--precision", choices=list(PRECISIONS), help="only the cases of this precision setup (JSON not written)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    started = time.perf_counter()
    results = []
    cases = all_cases(args.quick) if args.suite == "all" else precision_cases(args.quick)
    default_name = "experts_cpu.json" if args.suite == "all" else "experts_precisions_cpu.json"
    out_path = Path(args.out or Path(__file__).parent / "results" / default_name)
    if args.only:
        mode, tokens = args.only.split(":")
        cases = [c for c in cases if c["mode"] == mode and c["tokens"] == int(tokens)]
    if args.precision:
        cases = [c for c in cases if c["dtype"] == args.precision]
    for case in cases:
        results.append(run_case(case, args.timeout))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    _ratios(results)
    print_table(results)
    if args.only or args.precision:
        return
    meta = {
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": 1,
        "load_avg_at_end": os.getloadavg(),
        "total_wall_s": round(time.perf_counter() - started, 1),
        "note": "2-core CPU shared with other jobs; compare ratios within this run",
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
