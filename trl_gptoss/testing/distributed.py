"""Run a function on N gloo processes (spawned, ``file://`` rendezvous, hard timeouts) and collect results
(tests and benchmarks only).

Each worker writes its JSON result (or its traceback) to the run directory, so a failing rank reports why
instead of leaving its peers blocked: peers time out on the 120 s collective timeout, the parent on
``timeout``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # generous: the CI machine runs other suites beside us


def set_rank_environment(rank: int, world: int) -> None:
    """The variables accelerate (and so TRL's trainers) read to see this gloo process as one rank of a MULTI_CPU
    world; the process group itself comes from ``launch``'s rendezvous, which accelerate adopts."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="0",
    )


def _entry(worker, rank, world_size, run_dir, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(run_dir)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out / 'rendezvous'}",
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        result = worker(rank, world_size, *args)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.exit(1)


def launch(worker, world_size: int, run_dir: Path, *args, timeout: float = 300.0) -> list:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` processes; return the per-rank results."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_entry, args=(worker, rank, world_size, str(run_dir), args)) for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in hung:
        procs[rank].terminate()
        procs[rank].join(5)
    errors = {p.name: p.read_text() for p in sorted(run_dir.glob("rank*.err"))}
    if errors or hung:
        detail = "\n".join(f"--- {name}\n{text}" for name, text in errors.items())
        raise RuntimeError(f"ranks {hung} still running after {timeout:.0f}s; failed ranks:\n{detail}")
    return [json.loads((run_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]
