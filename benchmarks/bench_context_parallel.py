"""Per-rank peak memory and step time of sink-aware Ulysses context parallelism at sp = 1, 2, 4 (CPU, gloo).

Each setting spawns ``sp`` processes (one SP group). Every rank owns one long packed sequence (several
documents); one step is the owner loop: ``sp`` sub-steps, each a forward + backward over one sequence
sharded ``sp`` ways. Measured per rank:

- activation peak: peak RSS during the first full-length step minus RSS just before it (only a short
  warm-up step runs first, so the process-lifetime peak ``ru_maxrss`` is that step's); model in the baseline;
- step time (wall) and CPU time per step, median over ``--steps`` steps after that first one; on a 2-core
  machine sp = 4 oversubscribes the cores, so the CPU time is the fairer number there.

Self-check before anything is reported: rank 0's loss must equal the sp = 1 loss of the same sequence.

    .venv/bin/python benchmarks/bench_context_parallel.py --inner eager --seq-len 2048
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

from trl_gptoss.testing.distributed import launch

RESULTS = Path(__file__).resolve().parent / "results"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _packed_sequence(rank: int, seq_len: int, documents: int):
    """One row of ``seq_len`` tokens cut into ``documents`` documents of random lengths (seeded by rank)."""
    import torch

    gen = torch.Generator().manual_seed(rank)
    cuts = torch.randperm(seq_len - 1, generator=gen)[: documents - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, seq_len]
    ids = torch.randint(0, 512, (seq_len,), generator=gen)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])
    return ids, positions


def _as_padded_rows(ids, positions):
    """The documents of a packed row as a right-padded ``[n_docs, max_len]`` batch (what the runner packs)."""
    import torch

    starts = (positions == 0).nonzero()[:, 0].tolist() + [ids.shape[0]]
    spans = list(zip(starts[:-1], starts[1:]))
    rows = torch.zeros(len(spans), max(b - a for a, b in spans), dtype=torch.long)
    mask = torch.zeros_like(rows)
    for row, (a, b) in enumerate(spans):
        rows[row, : b - a], mask[row, : b - a] = ids[a:b], 1
    return rows, mask


def bench_worker(rank, world, inner, seq_len, documents, steps, heads):
    from torch.nn.parallel import DistributedDataParallel

    from trl_gptoss.parallel import ContextParallelPlugin, prepare_context_parallel
    from trl_gptoss.testing import tiny_gpt_oss

    # wrapped as in training: the gradient all-reduce is what sums each rank's partial gradients
    model = DistributedDataParallel(tiny_gpt_oss(seed=0, num_attention_heads=heads).train())
    plugin = ContextParallelPlugin(sp_size=world, inner_attention=inner)
    runner = prepare_context_parallel(None, model, plugin)
    rows, mask = _as_padded_rows(*_packed_sequence(rank, seq_len, documents))

    def loss_fn(token_logps):  # NLL per token of the sequence
        return -token_logps.sum() / seq_len

    # a short warm-up step puts one-off allocations (gloo buffers, autograd threads, oneDNN scratch) into the
    # baseline, so the measured peak is what scales with the sequence
    runner.forward_backward(*_as_padded_rows(*_packed_sequence(rank, 8 * world, 2)), loss_fn)
    model.zero_grad(set_to_none=True)
    baseline = _rss_bytes()
    first = runner.forward_backward(rows, mask, loss_fn)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    walls, cpus = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter(), time.process_time()
        runner.forward_backward(rows, mask, loss_fn)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {
        "loss": float(first.loss),
        "activation_peak_mib": (peak - baseline) / 2**20,
        "step_wall_s": statistics.median(walls),
        "step_cpu_s": statistics.median(cpus),
    }


def run(inner: str, seq_len: int, documents: int, sp_sizes, steps: int, heads: int) -> dict:
    rows = []
    for sp in sp_sizes:
        with tempfile.TemporaryDirectory() as run_dir:
            per_rank = launch(bench_worker, sp, Path(run_dir), inner, seq_len, documents, steps, heads, timeout=540)
        rows.append(
            {
                "sp": sp,
                "loss_rank0": per_rank[0]["loss"],
                "activation_peak_mib": max(r["activation_peak_mib"] for r in per_rank),
                "step_wall_s": max(r["step_wall_s"] for r in per_rank),
                "step_cpu_s": max(r["step_cpu_s"] for r in per_rank),
            }
        )
        print(f"sp={sp}: {rows[-1]}", flush=True)
    base = rows[0]
    for row in rows:
        drift = abs(row["loss_rank0"] - base["loss_rank0"])
        if drift > 1e-4:
            raise SystemExit(f"sp={row['sp']}: loss {row['loss_rank0']} differs from sp=1 by {drift:.2e}")
        row["memory_ratio"] = row["activation_peak_mib"] / base["activation_peak_mib"]
        # a step processes sp sequences (one per owner); per-sequence cost is step / sp
        row["wall_per_sequence_ratio"] = row["step_wall_s"] / row["sp"] / base["step_wall_s"]
        row["cpu_per_sequence_ratio"] = row["step_cpu_s"] / row["sp"] / base["step_cpu_s"]
    return {
        "inner": inner,
        "seq_len": seq_len,
        "documents": documents,
        "steps": steps,
        "heads": heads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "rows": rows,
    }


def _table(result: dict) -> str:
    lines = [
        f"inner={result['inner']}  T={result['seq_len']} ({result['documents']} documents), "
        f"{result['heads']} query heads",
        "| sp | activation peak / rank (MiB) | × sp=1 | step wall (s) | step CPU / rank (s) "
        "| wall per seq × sp=1 | CPU per seq × sp=1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['sp']} | {r['activation_peak_mib']:.0f} | {r['memory_ratio']:.2f} | "
            f"{r['step_wall_s']:.2f} | {r['step_cpu_s']:.2f} | {r['wall_per_sequence_ratio']:.2f} | "
            f"{r['cpu_per_sequence_ratio']:.2f} |"
        )
    return "\n".join(lines)


def _exact_rss_accounting():
    """Make RSS follow live tensor memory: a fixed mmap threshold returns every freed block >= 64 KiB to
    the OS at once (glibc's adaptive threshold otherwise keeps freed MiB-sized blocks in its heap, so later
    sub-steps of the owner loop would read as extra peak). Inherited by the spawned workers."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(64 * 1024))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inner", default="eager", choices=["eager", "fa3_sink"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--sp-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8, help="query heads of the tiny model (KV heads: 2)")
    args = parser.parse_args()
    if args.sp_sizes[0] != 1:
        raise SystemExit("--sp-sizes must start with 1 (the baseline every ratio refers to)")
    _exact_rss_accounting()
    result = run(args.inner, args.seq_len, args.documents, args.sp_sizes, args.steps, args.heads)
    print(_table(result))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"context_parallel_{args.inner}_T{args.seq_len}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
