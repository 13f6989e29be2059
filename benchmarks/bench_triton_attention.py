"""Triton sink attention on a CUDA GPU: TFLOP/s of forward and forward+backward, vs FA4's learnable_sink.

GPT-OSS attention shape (64 q heads, 8 kv heads, head_dim 64), bf16, packed documents of equal length
(``--docs``), full causal and sliding window 128. Self-verifying: before any timing, the Triton kernel
(and FA4 when importable on SM90+) is checked against the fp32 reference on a small case (o and every
gradient, dsinks included). FLOPs count only the unmasked (query, key) pairs of the causal/window band:
forward ``4 * pairs * Hq * D`` (QK^T and PV), backward ``2.5x`` that (five matmuls instead of two).

    python benchmarks/bench_triton_attention.py                       # table + JSON
    python benchmarks/bench_triton_attention.py --seqlens 2048,8192 --docs 2

Without CUDA it prints why and exits 0 (the CPU suite runs the kernels under TRITON_INTERPRET=1 instead).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HQ, HKV, DIM, WINDOW = 64, 8, 64, 128
RESULTS = Path(__file__).parent / "results" / "triton_attention_gpu.json"
DEVICE = "cuda"  # a dry run of verify() may set "cpu" under TRITON_INTERPRET=1


def _band_pairs(doc_len, window):
    """Number of (query, key) pairs a causal (windowed) document of ``doc_len`` tokens attends to."""
    if window is None or window >= doc_len:
        return doc_len * (doc_len + 1) // 2
    return window * (window + 1) // 2 + (doc_len - window) * window


def _inputs(total, docs, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(total, HQ, DIM, device=DEVICE, dtype=dtype, generator=gen)
    k, v = (torch.randn(total, HKV, DIM, device=DEVICE, dtype=dtype, generator=gen) for _ in range(2))
    sinks = torch.rand(HQ, device=DEVICE, generator=gen) * 4 - 1
    cu_seqlens = torch.arange(0, total + 1, total // docs, device=DEVICE, dtype=torch.int32)
    return q, k, v, sinks, cu_seqlens, total // docs


def _backends():
    from gptoss_kernels.triton import sink_attention_triton

    backends = {"triton": sink_attention_triton}
    try:
        from gptoss_kernels.fa4 import fa4_available, sink_attention_fa4
    except ImportError:
        return backends
    if fa4_available():
        backends["fa4"] = sink_attention_fa4
    return backends


def _run(fn, q, k, v, sinks, cu_seqlens, max_seqlen, window, backward):
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v, sinks)]
    o = fn(*leaves, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window)
    if not backward:
        return [o]
    return [o, *torch.autograd.grad(o, leaves, torch.ones_like(o) / o.shape[0])]


def verify(backends):
    """Every backend vs the fp32 reference on 2 documents of 700 tokens; raises on a mismatch."""
    from gptoss_kernels import sink_attention_ref

    for window in (None, WINDOW):
        q, k, v, sinks, cu, max_len = _inputs(1400, 2, torch.bfloat16, seed=1)
        ref_fn = lambda q, k, v, s, **kw: sink_attention_ref(
            q, k, v, s, cu_seqlens=kw["cu_seqlens"], window=kw["window"]
        )
        ref = _run(ref_fn, *(t.float() for t in (q, k, v)), sinks, cu, max_len, window, True)
        for name, fn in backends.items():
            got = _run(fn, q, k, v, sinks, cu, max_len, window, True)
            for label, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), got, ref):
                err = (a.float() - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
                if err > 2e-2:
                    raise SystemExit(f"{name} {label} window={window}: relative error {err:.2e} > 2e-2")
        print(f"verified {sorted(backends)} vs the fp32 reference (window={window})")


def _time_ms(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def bench_case(name, fn, seqlen, docs, window):
    q, k, v, sinks, cu, max_len = _inputs(seqlen * docs, docs, torch.bfloat16)
    flops_fwd = 4 * docs * _band_pairs(seqlen, window) * HQ * DIM
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    forward = lambda: fn(*leaves, cu_seqlens=cu, max_seqlen=max_len, window=window)
    o = forward()
    grad = torch.randn_like(o)
    fwd_ms = _time_ms(forward)
    fwd_bwd_ms = _time_ms(lambda: torch.autograd.grad(forward(), leaves, grad))
    return {
        "backend": name,
        "seqlen": seqlen,
        "docs": docs,
        "window": window,
        "fwd_ms": fwd_ms,
        "fwd_bwd_ms": fwd_bwd_ms,
        "fwd_tflops": flops_fwd / fwd_ms / 1e9,
        "fwd_bwd_tflops": 3.5 * flops_fwd / fwd_bwd_ms / 1e9,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="1024,2048,4096,8192,16384", help="tokens per document")
    parser.add_argument("--docs", type=int, default=1, help="packed documents per case")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_triton_attention: no CUDA device here; this benchmark needs a GPU "
            "(on CPU the kernels are tested under TRITON_INTERPRET=1, see docs/triton_kernels.md)"
        )
        return 0
    backends = _backends()
    verify(backends)
    rows = [
        bench_case(name, fn, int(t), args.docs, window)
        for window in (None, WINDOW)
        for t in args.seqlens.split(",")
        for name, fn in backends.items()
    ]
    print(f"{'backend':8} {'T':>6} {'window':>6} {'fwd ms':>8} {'fwd TF/s':>9} {'f+b ms':>8} {'f+b TF/s':>9}")
    for r in rows:
        print(
            f"{r['backend']:8} {r['seqlen']:>6} {str(r['window']):>6} {r['fwd_ms']:8.3f} "
            f"{r['fwd_tflops']:9.1f} {r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_tflops']:9.1f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
