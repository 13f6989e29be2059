"""What isolation the host offers, per-call uids, and finding processes a call left behind.

Two isolation levels (``PythonSandbox(isolation=...)``):

- ``"namespaces"`` (root + util-linux ``unshare``): fresh network namespace (no interfaces but a down
  loopback, so no network at all), PID namespace (the call's processes cannot see or signal host
  processes, and all die with the call's PID 1), mount namespace (whole filesystem read-only, private
  tmpfs ``/tmp``, ``/root`` hidden), per-call unprivileged uid, rlimits.
- ``"process"`` (fallback): own session/process group, rlimits, per-call uid when root, sockets blocked
  by a Python-level preamble (bypassable by ctypes/subprocess: it is a speed bump, not a wall), leftover
  processes found by a marker variable in their environment.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

UNSHARE_FLAGS = ("--net", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc")
UID_BASE = 1 << 28
SLOTS_PER_PROCESS = 1024
MARKER_VAR = "TRL_GPTOSS_SANDBOX_CALL"
ALWAYS_HIDDEN = ("/root", "/home")


@functools.lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """True when this process may create net+pid+mount namespaces with ``unshare`` (probed once)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return False
    try:
        probe = subprocess.run([unshare, *UNSHARE_FLAGS, "true"], capture_output=True, timeout=10, env={})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def detect_isolation() -> str:
    """The strongest isolation this host offers: ``"namespaces"`` or ``"process"``."""
    return "namespaces" if namespaces_available() else "process"


@functools.lru_cache(maxsize=8)
def interpreter_dirs(python: str) -> tuple[str, ...]:
    """Directories ``python`` needs to start: its real location, its own (virtualenv) root, ``sys.prefix`` and
    ``sys.base_prefix``. ``-S`` hides the virtualenv from ``sys.prefix``, so the venv root is added from the path."""
    query = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix]))"
    try:
        out = subprocess.run([python, "-I", "-S", "-c", query], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(
            f"python_executable={python!r} cannot be started ({exc}); pass a working Python."
        ) from exc
    prefixes = json.loads(out.stdout)
    real_dir = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    own_root = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    return tuple(sorted({os.path.realpath(p) for p in [*prefixes, real_dir, own_root]}))


def first_closed_ancestor(path: str) -> str | None:
    """The outermost ancestor of ``path`` that other users may not traverse (no ``o+x``), if any."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def hide_plan(python: str) -> list[tuple[str, list[str]]]:
    """``[(dir_to_hide, [paths_to_keep_visible]), ...]`` for the namespace init.

    ``/root`` and ``/home`` are always hidden (credentials live there); any other directory that blocks an
    unprivileged uid from reaching the interpreter is hidden too, with the interpreter bound back in.
    """
    keep = interpreter_dirs(python)
    hidden = {d for d in ALWAYS_HIDDEN if os.path.isdir(d) and not os.path.islink(d)}
    hidden |= {a for a in map(first_closed_ancestor, keep) if a is not None}
    plan = []
    for hide in sorted(hidden):
        inside = [p for p in keep if p.startswith(hide + "/")]
        plan.append((hide, inside))
    return plan


class UidSlots:
    """Hands out a distinct unprivileged uid to each running call of this Python process.

    ``RLIMIT_NPROC`` is counted per uid, system-wide: a uid per call means one call's fork bomb cannot
    starve a concurrent call, and ``pytest -n 2`` workers (different pids) never share uids. Slots are reused
    first-in first-out: a finished call's killed processes may linger as zombies for a moment, and zombies
    still count towards ``RLIMIT_NPROC`` of their uid, so the next call must not inherit that uid at once.
    One instance per process (``PROCESS_UID_SLOTS``), shared by every sandbox, for the same reason.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._free = collections.deque(range(SLOTS_PER_PROCESS))

    @contextmanager
    def uid(self) -> Iterator[int]:
        with self._lock:
            if not self._free:
                raise ValueError(
                    f"more than {SLOTS_PER_PROCESS} concurrent sandbox calls; lower max_concurrency."
                )
            slot = self._free.popleft()
        try:
            yield UID_BASE + (os.getpid() % (1 << 20)) * SLOTS_PER_PROCESS + slot
        finally:
            with self._lock:
                self._free.append(slot)


PROCESS_UID_SLOTS = UidSlots()


def marked_processes(marker: str) -> list[int]:
    """Pids whose environment carries ``MARKER_VAR=marker`` (readable ones: all of them when root)."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return found


def kill_marked(marker: str, rounds: int = 5) -> int:
    """SIGKILL every process carrying ``marker`` until none is left; return how many were killed."""
    killed = 0
    for _ in range(rounds):
        pids = [p for p in marked_processes(marker) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed
