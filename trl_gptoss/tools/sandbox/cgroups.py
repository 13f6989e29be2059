"""Per-call cgroups: one memory budget, one process budget and one CPU quota for everything a call starts.

rlimits are per process: 32 processes x ``RLIMIT_AS`` could still take 32 GiB. A cgroup caps the call as
a whole: ``memory`` (limit on resident memory + swap; the kernel OOM-kills inside the group) and ``pids``
(fork bombs fail with EAGAIN at ``max_processes``) and, when the host has the ``cpu`` controller, a CFS
quota (``cpu_cores`` cores' worth of time per period: ``RLIMIT_CPU`` is per process, so without it one
call could keep every core busy for its whole wall time). Supported layouts: cgroup v1 (separate
``/sys/fs/cgroup/memory`` and ``/sys/fs/cgroup/pids`` hierarchies) and cgroup v2 (one unified
hierarchy with both controllers enabled). Without write access (not root, read-only cgroupfs) the
sandbox runs without cgroups and says so in ``PythonSandbox.cgroups``.

Under bubblewrap the host moves the call's two bubblewrap processes into the groups while they are held
before the interpreter starts (``bwrap.py``); under process isolation ``init.py`` joins by writing ``0``
("myself") to each ``cgroup.procs``. Either way every process of the call inherits the groups.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import time
import warnings
from collections.abc import Iterator

ROOT = "/sys/fs/cgroup"
GROUP_PREFIX = "trl-gptoss-sandbox-"
# Group names carry this process's random token, not its pid: a call can read its own group's name
# (/proc/self/cgroup) and must learn nothing about the host from it.
PROCESS_TOKEN = secrets.token_hex(6)
CPU_PERIOD_US = 100_000


def _writable(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "cgroup.procs")) and os.access(path, os.W_OK)


@functools.lru_cache(maxsize=1)
def cgroup_layout() -> str | None:
    """``"v1"``, ``"v2"`` or ``None`` (no writable memory+pids cgroups), probed once."""
    if _writable(os.path.join(ROOT, "memory")) and _writable(os.path.join(ROOT, "pids")):
        return "v1"
    return "v2" if {"memory", "pids"} <= _v2_controllers() and _writable(ROOT) else None


def _v2_controllers() -> set[str]:
    try:
        with open(os.path.join(ROOT, "cgroup.subtree_control")) as f:
            return set(f.read().split())
    except OSError:
        return set()


@functools.lru_cache(maxsize=1)
def has_cpu_quota() -> bool:
    """True when a call's group can get a CPU quota (v1 ``cpu`` hierarchy, or v2 with ``cpu`` enabled)."""
    layout = cgroup_layout()
    if layout == "v1":
        return _writable(os.path.join(ROOT, "cpu")) and os.path.isfile(os.path.join(ROOT, "cpu", "cpu.cfs_quota_us"))
    return layout == "v2" and "cpu" in _v2_controllers()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _create(name: str, memory_bytes: int, max_processes: int, cpu_cores: float) -> list[str]:
    """Create the call's group(s), set the limits, return the directories."""
    quota = max(int(cpu_cores * CPU_PERIOD_US), 1000)
    if cgroup_layout() == "v1":
        directories = [os.path.join(ROOT, c, name) for c in ("memory", "pids", "cpu")[: 3 if has_cpu_quota() else 2]]
        for directory in directories:
            os.mkdir(directory)
        memory, pids = directories[:2]
        _write(os.path.join(memory, "memory.limit_in_bytes"), str(memory_bytes))
        swap = os.path.join(memory, "memory.memsw.limit_in_bytes")
        if os.path.exists(swap):  # memory + swap: the call may not push its excess to swap
            _write(swap, str(memory_bytes))
        _write(os.path.join(pids, "pids.max"), str(max_processes))
        if has_cpu_quota():
            _write(os.path.join(directories[2], "cpu.cfs_period_us"), str(CPU_PERIOD_US))
            _write(os.path.join(directories[2], "cpu.cfs_quota_us"), str(quota))
        return directories
    group = os.path.join(ROOT, name)
    os.mkdir(group)
    _write(os.path.join(group, "memory.max"), str(memory_bytes))
    with contextlib.suppress(OSError):  # memory.swap.max is absent without swap accounting
        _write(os.path.join(group, "memory.swap.max"), "0")
    _write(os.path.join(group, "pids.max"), str(max_processes))
    if has_cpu_quota():
        _write(os.path.join(group, "cpu.max"), f"{quota} {CPU_PERIOD_US}")
    return [group]


def _remove(directories: list[str], seconds: float = 2.0) -> None:
    """rmdir each group; a group stays busy for a moment while its last processes are reaped."""
    deadline = time.monotonic() + seconds
    for directory in directories:
        while True:
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if time.monotonic() > deadline:  # leak an empty group rather than fail the rollout
                    warnings.warn(f"could not remove sandbox cgroup {directory}: {exc}", stacklevel=3)
                    break
                time.sleep(0.01)


@contextlib.contextmanager
def call_cgroups(marker: str, memory_bytes: int, max_processes: int, cpu_cores: float) -> Iterator[list[str]]:
    """Yield the ``cgroup.procs`` paths the call's interpreter must join (``[]`` when unavailable)."""
    if cgroup_layout() is None:
        yield []
        return
    directories = _create(f"{GROUP_PREFIX}{PROCESS_TOKEN}-{marker}", memory_bytes, max_processes, cpu_cores)
    try:
        yield [os.path.join(d, "cgroup.procs") for d in directories]
    finally:
        _remove(directories)
