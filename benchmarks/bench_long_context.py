"""One real-width GPT-OSS-20B decoder layer, forward+backward on the CPU, with and without the long-context
options (``trl_gptoss.long_context``: token tiles, checkpoint offload): peak bytes per token above the layer's
inputs, checkpoint bytes left on the device, and the projection for whole models.

The layer as ``bench_gpu_layer.py`` builds it (hidden 2880, 64/8 heads of 64, 32 experts top-4, I = 2880, bf16
weights with fp32 norms, ``fa3_sink``, ``gptoss_sequential``, non-reentrant gradient checkpointing), here the
full-attention kind (the larger), as a LoRA run holds it: base weights frozen, sinks and router trained (their
gradients are small), the input requires grad. Each case runs in its own process with one thread
(``MALLOC_MMAP_THRESHOLD_`` pinned so freed tensors leave RSS) and measures:

- ``peak_bytes``: VmHWM above the RSS after building the layer, its input and the output cotangent (the
  "above its inputs" of docs/scaling.md), over one checkpointed forward+backward; the first step warms oneDNN's
  kernels and caches at the same shape, the second is measured;
- ``kept_after_forward_bytes``: RSS growth between the forward and the backward (the layer's output, plus on
  the CPU the offloaded input's host copy, which on a GPU is not device memory);
- ``checkpoint_bytes_on_device``: bytes of the layer's input resident on the device between its forward and
  backward (the offload's own accounting; the input itself without offload);
- ``saved_bytes``: distinct storages autograd keeps in one un-checkpointed forward (``saved_tensors_hooks``,
  parameters and input excluded): what the recompute holds while the backward runs;
- time: wall and CPU seconds of the measured step.

Per option set, ``peak_bytes_per_token_layer`` is the least-squares slope of the peak over the token counts
(the per-tile and per-call constants fall into the intercept). Usage::

    python benchmarks/bench_long_context.py [--tokens 1024,2048,4096,8192] [--tile 512] [--out PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

GIB = 2**30
HIDDEN, LAYERS_20B, LAYERS_120B = 2880, 24, 36
OPTION_SETS = {
    "plain": dict(token_tile=None, offload=False),
    "tiles": dict(token_tile=True, offload=False),
    "offload": dict(token_tile=None, offload=True),
    "tiles+offload": dict(token_tile=True, offload=True),
}


# ----------------------------------------------------------------------------------------------- worker side
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _layer(tile, offload):
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_gpu_layer import GPU_SHAPE, _checkpointing, build

    from trl_gptoss.long_context import enable_long_context

    model = build(GPU_SHAPE, "full_attention", "cpu")
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith("sinks") or ".router." in name)
    handle = enable_long_context(model, token_tile=tile, offload_checkpoints=offload)
    _checkpointing(model, True)
    return model, handle


def _saved_bytes(model, x, pos) -> int:
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    model.gradient_checkpointing_disable()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(inputs_embeds=x, position_ids=pos).last_hidden_state
    del out
    return sum(storages.values())


def run_worker(case: dict) -> dict:
    torch.set_num_threads(1)
    tokens = case["tokens"]
    model, handle = _layer(case["tile"], case["offload"])
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16, generator=gen)
    grad_out = torch.randn(x.shape, dtype=torch.bfloat16, generator=gen)
    pos = torch.arange(tokens)[None]
    record = {}

    def step(measure: bool):
        model.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_(True)  # owns its storage, as a layer's input does
        baseline = _reset_peak() if measure else 0
        wall, cpu = time.perf_counter(), time.process_time()
        out = model(inputs_embeds=inp, position_ids=pos).last_hidden_state
        if measure:
            record["kept_after_forward_bytes"] = _status_kib("VmRSS") * 1024 - baseline
            record["checkpoint_bytes_on_device"] = (
                handle.offload.device_input_bytes if handle.offload else inp.untyped_storage().nbytes()
            )
        out.backward(grad_out)
        if measure:
            record["peak_bytes"] = _status_kib("VmHWM") * 1024 - baseline
            record["wall_s"] = round(time.perf_counter() - wall, 2)
            record["cpu_s"] = round(time.process_time() - cpu, 2)
        return out.detach(), inp.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    step(measure=False)  # oneDNN's kernels and caches at this shape
    out, d_input, grads = step(measure=True)
    record["finite"] = bool(torch.isfinite(out).all() and torch.isfinite(d_input).all())
    record["trained_grads"] = sorted(grads)
    if handle.offload:
        record["offloaded_inputs"] = handle.offload.offloaded
        record["peak_resident_inputs"] = handle.offload.peak_device_inputs
    record["saved_bytes"] = _saved_bytes(model, x, pos)
    return {**case, **record, "output": out[0, :4, :4].float().tolist(), "d_input": d_input[0, :4, :4].tolist()}


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
    except subprocess.TimeoutExpired:
        return {**case, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {**case, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else f"rc {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares bytes per token over ``(tokens, bytes)`` (None for fewer than two token counts)."""
    if len({t for t, _ in points}) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_b = sum(b for _, b in points) / n
    return sum((t - mean_t) * (b - mean_b) for t, b in points) / sum((t - mean_t) ** 2 for t, _ in points)


def max_tokens(per_token_bytes: float, fixed_gib: float, budget_gib: float, sp: int = 1) -> int:
    """Most tokens whose device memory ``fixed + T / sp x per_token`` fits ``budget_gib`` (under sequence
    parallelism each rank holds the activations of ``T / sp`` tokens, attention's included: Ulysses trades
    tokens for heads)."""
    return int((budget_gib - fixed_gib) * GIB / per_token_bytes * sp)


def check_agreement(results: list[dict]) -> list[str]:
    """Every option set's output and input gradient (first 4x4 entries) equal the plain path's at the same
    tokens within bf16 rounding of the experts' regrouped rows (1e-2 relative)."""
    problems = []
    plain = {r["tokens"]: r for r in results if r["options"] == "plain" and "error" not in r}
    for r in results:
        base = plain.get(r["tokens"])
        if "error" in r or base is None or r is base:
            continue
        for key in ("output", "d_input"):
            a, b = torch.tensor(r[key]), torch.tensor(base[key])
            err = ((a - b).abs().max() / b.abs().max()).item()
            if err > 1e-2:
                problems.append(f"{r['options']} T={r['tokens']} {key}: {err:.2e} from plain")
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,2048,4096,8192")
    parser.add_argument("--tile", type=int, default=512, help="long_context_token_tile of the tiled cases")
    parser.add_argument("--options", default=",".join(OPTION_SETS), help="option sets to run")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per case")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "long_context_cpu.json"))
    parser.add_argument("--summarise", metavar="JSON", help="recompute the summary of a finished run's JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    if args.summarise:  # recompute the summary of a finished run (e.g. after changing the projection)
        record = json.loads(Path(args.summarise).read_text())
        record["summary"] = summarise(record["results"], record["summary"]["tile"])
        Path(args.summarise).write_text(json.dumps(record, indent=1) + "\n")
        print_table(record["results"], record["summary"])
        return
    started = time.perf_counter()
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name in args.options.split(","):
            opts = OPTION_SETS[name]
            case = {
                "options": name,
                "tokens": tokens,
                "tile": args.tile if opts["token_tile"] else None,
                "offload": opts["offload"],
            }
            results.append(run_case(case, args.timeout))
            print(
                json.dumps({k: v for k, v in results[-1].items() if k not in ("output", "d_input")}),
                file=sys.stderr,
                flush=True,
            )
    summary = summarise(results, args.tile)
    problems = check_agreement(results)
    print_table(results, summary)
    meta = {
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": 1,
        "load_avg_at_end": os.getloadavg(),
        "total_wall_s": round(time.perf_counter() - started, 1),
        "agreement_problems": problems,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "results": results}, indent=1) + "\n")
    if problems:
        raise SystemExit("; ".join(problems))


# The fixed device terms of a bf16 LoRA run, GiB (docs/scaling.md itemises them).
LOGPROB_HEAD_GIB = (201088 * HIDDEN * 4 + 2 * 320 * 201088 * 4) / GIB  # fp32 lm_head copy + two [320, V] tiles
FIXED_20B_GIB = {
    "weights_bf16": 20.9e9 * 2 / GIB,
    "lora_state": 0.1,  # rank-16 adapters on attention and experts, fp32 weights, grads and Adam moments
    "logprob_head": LOGPROB_HEAD_GIB,
    "cuda_context": 0.6,
}
FIXED_120B_SP8_GIB = {  # per rank of 8, FSDP2-sharded frozen bf16 base
    "weights_bf16_sharded": 116.8e9 * 2 / 8 / GIB,
    "gathered_layer": 6.0,  # one layer's all-gathered bf16 weights (docs/scaling.md: 6,128 MiB)
    "lora_state": 0.1,
    "logprob_head": LOGPROB_HEAD_GIB,
    "cuda_context": 0.6,
}
BUDGET_GIB = {"80gb": 80e9 / GIB, "141gb": 141e9 / GIB}  # as bench_gpu_layer.py's goal (74.5 GiB of 80 GB)


def per_token_terms(peak: float, offload: bool, layers: int) -> dict:
    """Device bytes per token while a layer runs its backward, beside the measured layer peak (which is above
    the layer's input and the incoming gradient: the benchmark allocates both before its baseline)."""
    return {
        "layer_peak": peak,
        "layer_input": 2 * HIDDEN,
        "incoming_gradient": 2 * HIDDEN,
        # offload: the next layer's input, prefetched; else every other layer's checkpoint
        "other_checkpoints": 2 * HIDDEN * (1 if offload else layers - 1),
        # LoRA (rank 32, fp32 adapters on the bf16 base, under bf16 autocast) keeps, per adapter, its own bf16
        # copy of the input (PEFT casts it to the adapter's fp32, autocast back to bf16 for lora_A): q, k, v the
        # normed input (3 x 2H), o_proj attention's output (2 x 4096), and each lora_A output [T, r] in fp32.
        # Not in the frozen-base peak. At tiny width saved_tensors_hooks counted 6.5 x 2H where this gives 5.5 x 2H
        # (docs/scaling.md): one [T, H]-sized copy unaccounted for, so this may be ~5.8 KB low.
        "lora_adapter_inputs": 3 * 2 * HIDDEN + 2 * 4096 + 4 * 32 * 4,
    }


def summarise(results: list[dict], tile: int) -> dict:
    summary = {"tile": tile, "fixed_20b_gib": FIXED_20B_GIB, "fixed_120b_sp8_gib": FIXED_120B_SP8_GIB}
    plain_time = {r["tokens"]: r["cpu_s"] for r in results if r["options"] == "plain" and "error" not in r}
    for name in OPTION_SETS:
        rows = [r for r in results if r["options"] == name and "error" not in r]
        if not rows:
            continue
        peak = slope([(r["tokens"], r["peak_bytes"]) for r in rows])
        offload = rows[0]["offload"]
        entry = {
            "peak_bytes_per_token_layer": peak,
            "saved_bytes_per_token_layer": slope([(r["tokens"], r["saved_bytes"]) for r in rows]),
            "checkpoint_bytes_per_token_on_device": max(r["checkpoint_bytes_on_device"] / r["tokens"] for r in rows),
            "cpu_time_vs_plain": {
                r["tokens"]: round(r["cpu_s"] / plain_time[r["tokens"]], 2) for r in rows if r["tokens"] in plain_time
            },
        }
        if peak is not None:
            terms20, terms120 = per_token_terms(peak, offload, LAYERS_20B), per_token_terms(peak, offload, LAYERS_120B)
            fixed20, fixed120 = sum(FIXED_20B_GIB.values()), sum(FIXED_120B_SP8_GIB.values())
            entry["per_token_bytes_20b"] = terms20
            entry["projected_max_tokens"] = {
                "20b_bf16_lora_80gb": max_tokens(sum(terms20.values()), fixed20, BUDGET_GIB["80gb"]),
                "20b_bf16_lora_141gb": max_tokens(sum(terms20.values()), fixed20, BUDGET_GIB["141gb"]),
                "120b_bf16_lora_sp8_8x80gb": max_tokens(sum(terms120.values()), fixed120, BUDGET_GIB["80gb"], sp=8),
            }
        summary[name] = entry
    return summary


def print_table(results, summary):
    print(
        "| options | T | peak MiB | peak B/token | saved B/token | kept after fwd MiB "
        "| checkpoint on device B/token | cpu s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['options']} | {r['tokens']} | error: {r['error']} |")
            continue
        print(
            f"| {r['options']} | {r['tokens']} | {r['peak_bytes'] / 2**20:.0f} | {r['peak_bytes'] / r['tokens']:.0f} | "
            f"{r['saved_bytes'] / r['tokens']:.0f} | {r['kept_after_forward_bytes'] / 2**20:.0f} | "
            f"{r['checkpoint_bytes_on_device'] / r['tokens']:.0f} | {r['cpu_s']} |"
        )
    print(json.dumps({k: v for k, v in summary.items() if not k.startswith("fixed")}, indent=1))


if __name__ == "__main__":
    main()
