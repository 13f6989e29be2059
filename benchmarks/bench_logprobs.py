"""The loss pass through lm_head: ``selective_logprobs`` vs TRL's paths, peak memory and time on the CPU.

One pass = forward of the per-token log-probs (and entropies) of the sampled tokens + backward of their sum, at
the GPT-OSS head (vocab 201,088, hidden 2,880, fp32), 4k and 16k tokens. Cases, each in a fresh one-thread process:

- ``trl``: TRL's non-fused path: ``logits = hidden @ W.T``, ``logits / T``, ``selective_log_softmax`` and
  ``entropy_from_logits`` under ``no_grad`` (the entropy feeds metrics and the high-entropy mask).
- ``trl_fused``: TRL 1.16's own fused head, ``trl.kernels.ChunkedLogProbFunction`` (its torch fallback on the CPU),
  with the tile widths ``add_fused_lm_head`` uses, log-probs and entropy.
- ``ours``: ``gptoss_kernels.selective_logprobs(..., return_entropy=True)``.

Peak = VmHWM - VmRSS around the pass (``/proc/self/clear_refs`` resets the high-water mark; glibc returns large
blocks with ``MALLOC_MMAP_THRESHOLD_``); it includes the fp32 weight gradient (V x H x 4 bytes), which every path
must produce, so the table also lists the peak without it. Time: wall and process CPU seconds (the machine is
shared; CPU time is the steadier of the two). Verified first, in every case process: the same pass at 32 tokens and
the first 8,192 vocabulary rows against the float64 reference; then across cases, the full-size log-probs,
entropies, hidden gradient and sampled weight-gradient rows must agree. A case whose estimated need exceeds
MemAvailable is reported as not fitting, never run.

Usage: ``python benchmarks/bench_logprobs.py [--tokens 4096 16384] [--out benchmarks/results/logprobs_cpu.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, TEMPERATURE = 201088, 2880, 1.0
CASES = ("trl", "trl_fused", "ours")
GIB = 2**30


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(field)


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable")


def _pass(case: str, hidden, weight, ids, chunk: int | None):
    """Forward of (logp, entropy) for ``case``; the loss is ``logp.sum()``."""
    import torch

    if case == "trl":
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        logits = hidden @ weight.T
        logits = logits / TEMPERATURE
        logp = selective_log_softmax(logits, ids)
        with torch.no_grad():
            entropy = entropy_from_logits(logits)
        return logp, entropy
    if case == "trl_fused":
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        logp, entropy, *_ = ChunkedLogProbFunction.apply(
            hidden, weight, None, ids, TEMPERATURE, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("entropy",)
        )
        return logp, entropy
    from gptoss_kernels import selective_logprobs

    return selective_logprobs(hidden, weight, ids, temperature=TEMPERATURE, return_entropy=True, chunk_size=chunk)


def _verify_small(case: str, chunk: int | None) -> float:
    """Max abs error of the case's pass vs the float64 reference at 32 tokens x 8,192 vocabulary rows."""
    import torch

    from gptoss_kernels import selective_logprobs_ref

    hidden = torch.randn(32, HIDDEN, requires_grad=True)
    weight = (torch.randn(8192, HIDDEN) * 0.02).requires_grad_()
    ids = torch.randint(0, 8192, (32,))
    logp, entropy = _pass(case, hidden, weight, ids, min(chunk or 16, 16))
    got = [logp, entropy, *torch.autograd.grad(logp.sum(), (hidden, weight))]
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    logp64, entropy64 = selective_logprobs_ref(h64, w64, ids, temperature=TEMPERATURE, return_entropy=True)
    want = [logp64, entropy64, *torch.autograd.grad(logp64.sum(), (h64, w64))]
    err = max((a.double() - b).abs().max().item() for a, b in zip(got, want))
    if err > 1e-3:
        raise RuntimeError(f"{case}: error {err:.3e} vs the float64 reference")
    return err


def run_case(case: str, tokens: int, chunk: int | None, save: str) -> dict:
    import torch

    torch.manual_seed(0)
    verify_err = _verify_small(case, chunk)
    hidden = torch.randn(tokens, HIDDEN, requires_grad=True)
    weight = (torch.randn(VOCAB, HIDDEN) * 0.02).requires_grad_()
    ids = torch.randint(0, VOCAB, (tokens,))
    base = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    wall, cpu = time.perf_counter(), time.process_time()
    logp, entropy = _pass(case, hidden, weight, ids, chunk)
    logp.sum().backward()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = (_status_kib("VmHWM") - base) / 1024
    rows = ids[:64]
    torch.save(
        {"logp": logp.detach(), "entropy": entropy.detach(), "d_hidden": hidden.grad, "d_weight": weight.grad[rows]},
        save,
    )
    grad_mib = VOCAB * HIDDEN * 4 / 2**20
    return {"wall_s": wall, "cpu_s": cpu, "peak_mib": peak, "peak_minus_weight_grad_mib": peak - grad_mib,
            "verify_max_err_vs_f64": verify_err, "load_avg_1m": os.getloadavg()[0]}  # fmt: skip


def _need_bytes(case: str, tokens: int, chunk: int) -> int:
    """Estimated peak beyond the inputs: the fp32 weight gradient plus the path's [rows, V] tensors."""
    rows = {"trl": 3 * tokens, "trl_fused": 4 * min(tokens, 4096) * 32768 // VOCAB + 1, "ours": 2 * chunk}[case]
    return VOCAB * HIDDEN * 4 + rows * VOCAB * 4


def _subprocess(case: str, tokens: int, chunk: int | None, save: str) -> dict:
    from gptoss_kernels.logprobs import default_chunk_size

    need = _need_bytes(case, tokens, chunk or default_chunk_size(VOCAB)) + 2 * VOCAB * HIDDEN * 4
    if need > 0.9 * _mem_available():
        return {"not_run": f"needs ~{need / GIB:.1f} GiB, MemAvailable {_mem_available() / GIB:.1f} GiB"}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "TRL_EXPERIMENTAL_SILENCE": "1"}
    cmd = [sys.executable, __file__, "--case", case, "--tokens", str(tokens), "--save", save]
    if chunk:
        cmd += ["--chunk", str(chunk)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=7200)
    if done.returncode:
        raise RuntimeError(f"case {case}@{tokens} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _agreement(saved: dict[str, str]) -> dict:
    """Max abs difference of ours vs each TRL case on the full-size outputs; raises when they disagree."""
    import torch

    ours = torch.load(saved["ours"])
    out = {}
    for case, path in saved.items():
        if case == "ours":
            continue
        other = torch.load(path)
        diffs = {k: (ours[k] - other[k]).abs().max().item() for k in ours}
        scale = {k: max(other[k].abs().max().item(), 1e-30) for k in ours}
        if any(diffs[k] > 1e-3 * max(1.0, scale[k]) for k in ours):
            raise RuntimeError(f"ours vs {case} disagree: {diffs}")
        out[case] = diffs
    return out


def _write(cli, results: dict, summary: dict) -> None:
    Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cli.out).write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "threads": 1,
                "shape": {"vocab": VOCAB, "hidden": HIDDEN, "dtype": "float32", "temperature": TEMPERATURE},
                "chunk_size": cli.chunk,
                "cases": results,
                "summary": summary,
            },
            indent=2,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--chunk", type=int, default=None)
    parser.add_argument("--case")
    parser.add_argument("--save")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/logprobs_cpu.json"))
    cli = parser.parse_args()
    if cli.case:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(run_case(cli.case, cli.tokens[0], cli.chunk, cli.save)))
        return
    results, summary = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in cli.tokens:
            saved = {}
            for case in cli.cases:
                save = f"{tmp}/{case}_{tokens}.pt"
                results[f"{case}@{tokens}"] = _subprocess(case, tokens, cli.chunk, save)
                print(f"{case}@{tokens}: {results[f'{case}@{tokens}']}", flush=True)
                _write(cli, results, summary)  # a long run keeps what it has measured
                if Path(save).exists():
                    saved[case] = save
            if "ours" in saved and len(saved) > 1:
                summary[f"agreement@{tokens}"] = _agreement(saved)
            for other in ("trl", "trl_fused"):
                mine, theirs = results.get(f"ours@{tokens}", {}), results.get(f"{other}@{tokens}", {})
                if "wall_s" in mine and "wall_s" in theirs:
                    summary[f"ours_over_{other}@{tokens}"] = {
                        k: mine[k] / theirs[k] for k in ("wall_s", "cpu_s", "peak_mib", "peak_minus_weight_grad_mib")
                    }
    print(f"\n{'case':<18}{'wall s':>9}{'cpu s':>9}{'peak MiB':>10}{'- dW MiB':>10}{'load':>6}")
    for name, r in results.items():
        if "not_run" in r:
            print(f"{name:<18}  not run: {r['not_run']}")
            continue
        print(f"{name:<18}{r['wall_s']:>9.1f}{r['cpu_s']:>9.1f}{r['peak_mib']:>10.0f}"
              f"{r['peak_minus_weight_grad_mib']:>10.0f}{r['load_avg_1m']:>6.1f}")  # fmt: skip
    print(json.dumps(summary, indent=1))
    _write(cli, results, summary)


if __name__ == "__main__":
    main()
