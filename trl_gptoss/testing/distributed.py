"""Run a function on N gloo processes (spawned, ``file://`` rendezvous, hard timeouts) and collect results
(tests and benchmarks only).

Each worker writes its JSON result (or its traceback) to the run directory, so a failing rank reports why
instead of leaving its peers blocked: peers time out on the 120 s collective timeout, the parent on
``timeout``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
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


class WorldFailed(RuntimeError):
    """A rank raised, hung or died. ``signalled``: a rank died without a traceback (killed, segfault, abort; its
    peers' errors may only follow from it), which a second run can tell apart from a failure of the code under
    test."""

    def __init__(self, message: str, signalled: bool):
        super().__init__(message)
        self.signalled = signalled


def _entry(worker, rank, world_size, run_dir, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(run_dir)
    # A fatal signal (segfault, abort from C++) skips the ``except`` below: the Python stacks go here instead.
    faulthandler.enable(open(out / f"rank{rank}.fault", "w"))  # noqa: SIM115  (open until the process ends)
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
    # A rank killed by a signal (the OOM killer's SIGKILL, a segfault) writes neither a result nor a traceback:
    # name it and its exit code rather than failing later on a missing rank file.
    silent = {
        rank: _exit_reason(proc.exitcode)
        for rank, proc in enumerate(procs)
        if rank not in hung and not (run_dir / f"rank{rank}.json").exists() and f"rank{rank}.err" not in errors
    }
    if errors or hung or silent:
        detail = [f"ranks {hung} still running after {timeout:.0f}s (terminated)"] if hung else []
        detail += [f"--- {name}\n{text}" for name, text in errors.items()]
        detail += [
            f"--- rank{rank}: {why}, no result or traceback{_fault(run_dir, rank)}" for rank, why in silent.items()
        ]
        raise WorldFailed("the gloo world failed:\n" + "\n".join(detail), signalled=bool(silent))
    return [json.loads((run_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _fault(run_dir: Path, rank: int) -> str:
    """What ``faulthandler`` wrote for ``rank`` (the Python stacks at a fatal signal), if anything."""
    path = run_dir / f"rank{rank}.fault"
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    return f"; its fatal-signal stacks:\n{text}" if text else ""
