"""The SP loss pass's head at GPT-OSS's vocabulary: ``selective_logprobs`` tiles vs full per-shard logits (CPU).

One SP group of ``--sp`` gloo processes (DDP-wrapped tiny GPT-OSS with ``vocab_size`` 201,088); every rank owns
one packed row of ``--seq-len`` tokens; one step is the owner loop (forward + backward of each member's row,
sharded). Two heads, each in fresh processes:

- ``selective``: what the runner does (``HeadConfig``, default tile of ``default_chunk_size(V)`` rows);
- ``logits``: the projection the runner used before -- ``[T/sp, V]`` fp32 logits per shard, ``log_softmax``,
  gather -- through the same owner loop.

Per rank: peak RSS of the measured step minus RSS before it (a short warm-up step first; glibc returns freed
blocks at once, see ``MALLOC_MMAP_THRESHOLD_``), and the step's wall / CPU time. Self-check: both heads give
the same loss on rank 0 (relative 1e-5) before anything is reported.

    .venv/bin/python benchmarks/bench_sp_head.py --seq-len 4096 --sp 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

from trl_gptoss.testing.distributed import launch

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 201_088


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _batch(rank: int, seq_len: int, rows: int = 4):
    """``rows`` right-padded documents of ``seq_len`` valid tokens in all (seeded by rank)."""
    import torch

    gen = torch.Generator().manual_seed(rank)
    length = seq_len // rows
    ids = torch.randint(0, VOCAB, (rows, length), generator=gen)
    return ids, torch.ones_like(ids)


def bench_worker(rank, world, head_kind, seq_len, hidden):
    from torch.nn.parallel import DistributedDataParallel

    from trl_gptoss.parallel import ContextParallelPlugin, prepare_context_parallel
    from trl_gptoss.parallel.batching import token_log_probs
    from trl_gptoss.parallel.engine import ContextParallelRunner
    from trl_gptoss.testing import tiny_gpt_oss

    class LogitsRunner(ContextParallelRunner):
        """The per-shard projection the runner used before ``selective_logprobs``."""

        def local_token_values(self, input_ids, positions, labels, model=None, head=None):
            return token_log_probs(self.local_logits(input_ids, positions, model), labels), None

    model = DistributedDataParallel(tiny_gpt_oss(seed=0, vocab_size=VOCAB, hidden_size=hidden).train())
    runner = prepare_context_parallel(None, model, ContextParallelPlugin(sp_size=world, inner_attention="fa3_sink"))
    if head_kind == "logits":
        runner = LogitsRunner(runner.model, runner.sp, None, runner.attention, runner.head)

    def loss_fn(token_logps):
        return -token_logps.sum() / seq_len

    runner.forward_backward(*_batch(rank, 16 * world, rows=2), loss_fn)  # warm-up: one-off allocations
    model.zero_grad(set_to_none=True)
    baseline = _rss_bytes()
    wall, cpu = time.perf_counter(), time.process_time()
    result = runner.forward_backward(*_batch(rank, seq_len), loss_fn)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"loss": float(result.loss), "peak_mib": (peak - baseline) / 2**20, "wall_s": wall, "cpu_s": cpu}


def run(seq_len: int, sp: int, hidden: int) -> dict:
    rows = {}
    for kind in ("logits", "selective"):
        with tempfile.TemporaryDirectory() as run_dir:
            per_rank = launch(bench_worker, sp, Path(run_dir), kind, seq_len, hidden, timeout=590)
        rows[kind] = {
            "loss_rank0": per_rank[0]["loss"],
            "peak_mib": max(r["peak_mib"] for r in per_rank),
            "wall_s": max(r["wall_s"] for r in per_rank),
            "cpu_s": max(r["cpu_s"] for r in per_rank),
        }
        print(f"{kind}: {rows[kind]}", flush=True)
    drift = abs(rows["selective"]["loss_rank0"] - rows["logits"]["loss_rank0"])
    if drift > 1e-5 * abs(rows["logits"]["loss_rank0"]):
        raise SystemExit(
            f"the heads disagree: loss {rows['selective']['loss_rank0']} vs {rows['logits']['loss_rank0']}"
        )
    return {
        "seq_len_per_rank": seq_len,
        "sp": sp,
        "vocab": VOCAB,
        "hidden": hidden,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "rows": rows,
        "peak_ratio": rows["selective"]["peak_mib"] / rows["logits"]["peak_mib"],
        "cpu_ratio": rows["selective"]["cpu_s"] / rows["logits"]["cpu_s"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096, help="valid tokens per rank (one packed row)")
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the tiny model")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # RSS follows live tensors (inherited)
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(64 * 1024))
    result = run(args.seq_len, args.sp, args.hidden)
    print(f"T={args.seq_len}/rank, sp={args.sp}, V={VOCAB}, H={args.hidden}")
    print("| head | peak / rank (MiB) | step wall (s) | step CPU / rank (s) |\n|---|---|---|---|")
    for kind, row in result["rows"].items():
        print(f"| {kind} | {row['peak_mib']:.0f} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} |")
    print(f"selective / logits: peak {result['peak_ratio']:.3f}x, CPU {result['cpu_ratio']:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"sp_head_T{args.seq_len}_sp{args.sp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
