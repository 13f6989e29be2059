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

A group stays busy for a moment after the call's processes are killed (the kernel tears the PID and mount
namespaces down asynchronously). The call waits ``REMOVE_WAIT`` for it, then returns and leaves the group
to ``reap()``, which every later call and every new ``PythonSandbox`` runs: it removes this process's
pending groups, and groups of any other process (a host that was killed mid-call) that are empty and
older than ``FOREIGN_AGE``; a group in use is never removed (the kernel refuses ``rmdir`` while it holds
a process). Memory cgroup ids are finite (65535 per host), so no group may be leaked for good.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import os
import secrets
import threading
import time
from collections.abc import Iterator

ROOT = "/sys/fs/cgroup"
GROUP_PREFIX = "trl-gptoss-sandbox-"
# Group names carry this process's random token, not its pid: a call can read its own group's name
# (/proc/self/cgroup) and must learn nothing about the host from it.
PROCESS_TOKEN = secrets.token_hex(6)
CPU_PERIOD_US = 100_000
REMOVE_WAIT = 0.2  # seconds a call waits for its groups to empty before leaving them to reap()
FOREIGN_AGE = 60.0  # another process's empty group this old is a leftover (no call takes a minute to join)

_pending: set[str] = set()  # this process's groups that could not be removed yet
_pending_lock = threading.Lock()


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


def _try_rmdir(directory: str) -> bool:
    """True when ``directory`` is gone (removed now, or already)."""
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        return True
    except OSError:  # EBUSY: processes still in it
        return False
    return True


def _remove(directories: list[str], seconds: float = REMOVE_WAIT) -> None:
    """rmdir each group, waiting at most ``seconds`` in all; the rest is left to ``reap()``."""
    deadline = time.monotonic() + seconds
    for directory in directories:
        while not _try_rmdir(directory):
            if time.monotonic() > deadline:
                with _pending_lock:
                    _pending.add(directory)
                break
            time.sleep(0.01)


def all_groups() -> list[str]:
    """Every per-call group on this host, of any process."""
    pattern = f"{GROUP_PREFIX}*"
    return glob.glob(os.path.join(ROOT, "*", pattern)) + glob.glob(os.path.join(ROOT, pattern))


def reap(foreign: bool = False) -> int:
    """Remove this process's pending groups (and, with ``foreign``, other processes' empty groups older
    than ``FOREIGN_AGE``); return how many were removed."""
    with _pending_lock:
        pending = list(_pending)
    removed = 0
    for directory in pending:
        if _try_rmdir(directory):
            removed += 1
            with _pending_lock:
                _pending.discard(directory)
    if foreign:
        own = f"{GROUP_PREFIX}{PROCESS_TOKEN}-"
        now = time.time()
        for directory in all_groups():
            if os.path.basename(directory).startswith(own):
                continue
            with contextlib.suppress(OSError):
                if now - os.stat(directory).st_mtime > FOREIGN_AGE and _try_rmdir(directory):
                    removed += 1
    return removed


atexit.register(reap)


def pending() -> list[str]:
    """This process's groups still waiting for ``reap()``."""
    with _pending_lock:
        return sorted(_pending)


@contextlib.contextmanager
def call_cgroups(marker: str, memory_bytes: int, max_processes: int, cpu_cores: float) -> Iterator[list[str]]:
    """Yield the ``cgroup.procs`` paths the call's interpreter must join (``[]`` when unavailable)."""
    if cgroup_layout() is None:
        yield []
        return
    if _pending:
        reap()
    name = f"{GROUP_PREFIX}{PROCESS_TOKEN}-{marker}"
    try:
        directories = _create(name, memory_bytes, max_processes, cpu_cores)
    except BaseException:  # e.g. ENOSPC on the second hierarchy: remove what the first mkdir made
        _remove([os.path.join(ROOT, c, name) for c in ("memory", "pids", "cpu")] + [os.path.join(ROOT, name)])
        raise
    try:
        yield [os.path.join(d, "cgroup.procs") for d in directories]
    finally:
        _remove(directories)
