"""Sink attention on this CPU: fa3_sink's CPU paths vs transformers GPT-OSS eager and torch SDPA, fwd + bwd.

``auto`` is what ``sink_attention`` (and so ``fa3_sink``) runs: full-causal layers through torch's fused CPU
flash kernel plus the sink rescale (``fused_cpu.py``), windowed ones through the chunked tiles; ``chunked``
forces the tile path everywhere.

GPT-OSS attention shape (64 q heads, 8 kv heads, head_dim 64), one sequence, fp32; sliding window 128
and full causal. Self-verifying: every implementation is first checked against the float64 reference
(o and all gradients) at T=300; then each timed case runs in a fresh subprocess, so its peak memory
(VmHWM after resetting it, minus the RSS with inputs already allocated) is its own. torch SDPA without
sinks (not sink-exact; what flash-attn 2/3 silently compute) is listed for scale.

    .venv/bin/python benchmarks/bench_sink_attention.py                 # table + JSON
    .venv/bin/python benchmarks/bench_sink_attention.py --long 8192,16384,32768 --long-full 16384
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HQ, HKV, DIM, WINDOW = 64, 8, 64, 128
RESULTS = Path(__file__).parent / "results" / "sink_attention_cpu.json"


def _inputs(seqlen, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seqlen, HQ, DIM, generator=gen, dtype=dtype)
    k, v = (torch.randn(1, seqlen, HKV, DIM, generator=gen, dtype=dtype) for _ in range(2))
    sinks = torch.rand(HQ, generator=gen, dtype=dtype) * 4 - 1
    return [t.requires_grad_() for t in (q, k, v, sinks)]


def _eager(q, k, v, sinks, window):
    """transformers' GPT-OSS eager attention with the additive causal/sliding mask it is normally given."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    seqlen = q.shape[1]
    pos = torch.arange(seqlen)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(seqlen, seqlen, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=HQ // HKV, training=True)
    out, _ = eager_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[None, None], scaling=DIM**-0.5
    )
    return out


def _sdpa_no_sinks(q, k, v, sinks, window):
    seqlen = q.shape[1]
    pos = torch.arange(seqlen)
    allowed = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window else True)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=None if window is None else allowed,
        is_causal=window is None,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def _chunked(q, k, v, sinks, window):
    from gptoss_kernels import sink_attention_chunked

    return sink_attention_chunked(q, k, v, sinks, window=window)


def _auto(q, k, v, sinks, window):
    from gptoss_kernels import sink_attention

    return sink_attention(q, k, v, sinks, window=window)


IMPLS = {"auto": _auto, "chunked": _chunked, "eager": _eager, "sdpa-no-sinks": _sdpa_no_sinks}


def verify(seqlen=300):
    """Every sink-exact implementation vs the float64 reference: o, dq, dk, dv, dsinks within 1e-5 rel."""
    from gptoss_kernels import sink_attention_ref

    for window in (WINDOW, None):
        leaves64 = _inputs(seqlen, torch.float64)
        grad = torch.randn(1, seqlen, HQ, DIM, dtype=torch.float64)
        out = sink_attention_ref(*leaves64, window=window)
        want = [out, *torch.autograd.grad(out, leaves64, grad)]
        for name in ("auto", "chunked", "eager"):
            leaves = [t.detach().float().requires_grad_() for t in leaves64]
            out = IMPLS[name](*leaves, window)
            got = [out, *torch.autograd.grad(out, leaves, grad.float())]
            for label, g, w in zip(("o", "dq", "dk", "dv", "dsinks"), got, want):
                err = (g.double() - w).abs().max().item() / max(w.abs().max().item(), 1.0)
                if err > 1e-5:
                    raise SystemExit(f"verification failed: {name} window={window} {label} rel err {err:.2e}")
    print(f"verified auto, chunked and eager vs float64 reference at T={seqlen} (o, dq, dk, dv, dsinks <= 1e-5 rel)")


def _rss_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_case(impl, seqlen, window, reps, threads):
    """In this (fresh) process: peak extra RSS of the first fwd+bwd (after a T=16 warm-up), best time over
    ``reps`` runs."""
    torch.set_num_threads(threads)
    # Warm-up at T=16: imports, OpenMP threads and allocator arenas are not the workload's memory.
    warm = _inputs(16)
    torch.autograd.grad(
        IMPLS[impl](*warm, window), warm[:3] if impl == "sdpa-no-sinks" else warm, torch.randn(1, 16, HQ, DIM)
    )
    del warm
    leaves = _inputs(seqlen)
    grad = torch.randn(1, seqlen, HQ, DIM)
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM so the peak is this workload's
    times, cpu_times = [], []
    for rep in range(reps):
        start, cpu_start = time.perf_counter(), time.process_time()
        out = IMPLS[impl](*leaves, window)
        torch.autograd.grad(out, leaves[:3] if impl == "sdpa-no-sinks" else leaves, grad)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        if rep == 0:
            peak_mib = (_rss_kib("VmHWM") - before) / 1024
            finite = bool(torch.isfinite(out).all())
        del out
    return dict(
        impl=impl,
        seqlen=seqlen,
        window=window,
        time_s=min(times),
        cpu_s=min(cpu_times),
        peak_mib=peak_mib,
        finite=finite,
        threads=torch.get_num_threads(),
    )


def _spawn(impl, seqlen, window, reps, threads):
    cmd = [sys.executable, __file__, "--case", impl, str(seqlen), str(window or 0), str(reps), str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return dict(impl=impl, seqlen=seqlen, window=window, error=proc.stderr.strip().splitlines()[-1:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(rows):
    lines = [
        "| impl | T | window | fwd+bwd wall s | fwd+bwd cpu-s | peak MiB | wall / eager | cpu-s / eager "
        "| memory / eager | memory / sdpa |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager = {(r["seqlen"], r["window"]): r for r in rows if r["impl"] == "eager" and "error" not in r}
    sdpa = {(r["seqlen"], r["window"]): r for r in rows if r["impl"] == "sdpa-no-sinks" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['seqlen']} | {r['window'] or 'full'} | error: {r['error']} |||||")
            continue
        base = eager.get((r["seqlen"], r["window"]))
        ratios = [f"{r[key] / base[key]:.2f}" if base else "-" for key in ("time_s", "cpu_s", "peak_mib")]
        plain = sdpa.get((r["seqlen"], r["window"]))
        ratios.append(f"{r['peak_mib'] / plain['peak_mib']:.2f}" if plain else "-")
        lines.append(
            f"| {r['impl']} | {r['seqlen']} | {r['window'] or 'full'} | {r['time_s']:.2f} | "
            f"{r['cpu_s']:.2f} | {r['peak_mib']:.0f} | {' | '.join(ratios)} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", nargs=5, metavar=("IMPL", "T", "WINDOW", "REPS", "THREADS"), help=argparse.SUPPRESS)
    parser.add_argument("--lengths", default="1024,2048", help="T for the eager comparison (<= 2048)")
    parser.add_argument("--long", default="8192,16384,32768", help="extra T for chunked, window 128")
    parser.add_argument("--long-full", default="8192,16384", help="extra T for chunked, full attention")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads; 1 gives comparable cpu-s on a contended machine (no spin-waiting)",
    )
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.case:
        impl, seqlen, window, reps, threads = args.case
        print(json.dumps(run_case(impl, int(seqlen), int(window) or None, int(reps), int(threads))))
        return
    verify()
    rows = []
    for seqlen in (int(t) for t in args.lengths.split(",") if t):
        for window in (WINDOW, None):
            for impl in ("eager", "auto", "chunked", "sdpa-no-sinks"):
                rows.append(_spawn(impl, seqlen, window, args.reps, args.threads))
                print(rows[-1], flush=True)
    for window, lengths in ((WINDOW, args.long), (None, args.long_full)):
        for seqlen in (int(t) for t in lengths.split(",") if t):
            rows.append(_spawn("chunked", seqlen, window, 1, args.threads))
            print(rows[-1], flush=True)
    print(_table(rows))
    meta = dict(
        shape=dict(hq=HQ, hkv=HKV, head_dim=DIM, batch=1),
        dtype="float32",
        cpu_count=os.cpu_count(),
        load_average=os.getloadavg(),
        torch=torch.__version__,
        rows=rows,
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
