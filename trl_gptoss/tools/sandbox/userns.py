"""Who runs a call: per-call uids, the user namespaces that map them, and whether the host allows any.

The model's code runs as uid ``SANDBOX_UID`` inside a user namespace. When the host process is root, that uid
maps to an unprivileged host uid of its own per concurrent call (``UidSlots``), so the code owns nothing on
the host, and ``RLIMIT_NPROC`` counts only that call's processes. Root builds one user namespace per host
uid, mapping ``0 -> 0`` (bubblewrap sets the sandbox up as that root, which can still reach an interpreter
under ``/root``) and ``SANDBOX_UID -> host uid`` (``init.py`` switches to it before the code runs). A host that
is not root lets bubblewrap create an unprivileged user namespace per call, and the code keeps the host uid.
"""

from __future__ import annotations

import collections
import functools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

UID_BASE = 1 << 28
SLOTS_PER_PROCESS = 1024
SANDBOX_UID = 1000

USERNS_HELP = (
    "user namespaces are disabled on this host ({reason}). Enable them: `sysctl -w user.max_user_namespaces="
    "15000` (and on Debian/Ubuntu kernels `sysctl -w kernel.unprivileged_userns_clone=1`; on Ubuntu 23.10+ "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`); in Docker, run with a seccomp profile that "
    "allows unshare/clone(CLONE_NEWUSER) (e.g. `--security-opt seccomp=unconfined`). Or choose "
    "PythonSandbox(isolation='process'), which is weaker: the code can read every file its uid can read "
    "(see docs/tools_and_rewards.md)."
)

# Runs in a throw-away child: enter a new user namespace, report, wait until the host has mapped it.
_HELPER = (
    "import ctypes, os\n"
    "if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:\n"
    "    os.write(1, os.strerror(ctypes.get_errno()).encode()); os._exit(1)\n"
    "os.write(1, b'+'); os.read(0, 1)\n"
)


class UserNamespaceError(RuntimeError):
    """The host does not let us create user namespaces (``PythonSandbox`` adds how to enable them)."""


class UserNamespaces:
    """Root only: user namespaces mapping ``0 -> 0`` and sandbox uids to host uids, each kept open as an fd:
    one per host uid (``SANDBOX_UID -> uid``, a bubblewrap per call) and one per range of this process's
    slots (``SANDBOX_UID + k -> first + k``, the zygote's, whose calls run as ``SANDBOX_UID + slot``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._fds: dict[tuple[int, int], int] = {}

    def fd_for(self, host_uid: int, count: int = 1) -> int:
        """The namespace mapping ``SANDBOX_UID .. SANDBOX_UID + count - 1`` to ``host_uid ..``."""
        with self._lock:
            if (host_uid, count) not in self._fds:
                self._fds[host_uid, count] = _map_new_namespace(host_uid, count)
            return self._fds[host_uid, count]


def process_uid_base(pid: int | None = None) -> int:
    """The first host uid of process ``pid``'s slots (default: this process); slot ``k`` is this + ``k``."""
    pid = os.getpid() if pid is None else pid
    return UID_BASE + (pid % (1 << 20)) * SLOTS_PER_PROCESS


def _map_new_namespace(host_uid: int, count: int = 1) -> int:
    helper = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={}
    )
    try:
        status = os.read(helper.stdout.fileno(), 256)
        if status != b"+":
            raise UserNamespaceError(f"unshare(CLONE_NEWUSER): {status.decode(errors='replace')}")
        mapping = f"0 0 1\n{SANDBOX_UID} {host_uid} {count}\n"
        for kind in ("uid_map", "gid_map"):
            with open(f"/proc/{helper.pid}/{kind}", "w") as f:
                f.write(mapping)
        return os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        helper.stdin.close()
        helper.stdout.close()
        helper.wait()


PROCESS_USER_NAMESPACES = UserNamespaces()


@functools.lru_cache(maxsize=1)
def user_namespace_problem() -> str | None:
    """``None`` when this process can give calls a user namespace, else why not (probed once)."""
    if os.geteuid() == 0:
        try:
            PROCESS_USER_NAMESPACES.fd_for(UID_BASE - 1)  # a probe uid no call uses
        except (UserNamespaceError, OSError) as exc:
            return str(exc)
        return None
    from trl_gptoss.tools.sandbox.view import bwrap_path

    try:
        probe = subprocess.run(
            [bwrap_path(), "--unshare-user", "--ro-bind", "/", "/", "true"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not start: {exc}"
    return None if probe.returncode == 0 else probe.stderr.decode(errors="replace").strip()


class UidLease:
    """One call's host uid; ``killed`` (set by the caller) keeps the uid out of use for ``REUSE_AFTER`` s."""

    def __init__(self, uid: int):
        self.uid = uid
        self.killed = False


class UidSlots:
    """Hands out a distinct unprivileged host uid to each running call of this Python process.

    ``pytest -n 2`` workers (different pids) never share uids. Released uids are reused oldest first, so a
    process opens about as many as its peak concurrency (each with its user namespace, built once). A call
    that was killed from the host may leave its PID namespace dying for a moment, and those processes still
    count towards ``RLIMIT_NPROC`` of their uid: its uid waits ``REUSE_AFTER`` seconds before reuse. One
    instance per process (``PROCESS_UID_SLOTS``), shared by every sandbox.
    """

    REUSE_AFTER = 1.0

    def __init__(self):
        self._lock = threading.Lock()
        self._free: collections.deque[tuple[int, float]] = collections.deque()  # (slot, usable from)
        self._opened = 0

    def _take(self) -> int:
        with self._lock:
            if self._free and self._free[0][1] <= time.monotonic():
                return self._free.popleft()[0]
            if self._opened < SLOTS_PER_PROCESS:
                self._opened += 1
                return self._opened - 1
            if self._free:
                return self._free.popleft()[0]
        raise ValueError(f"more than {SLOTS_PER_PROCESS} concurrent sandbox calls; lower max_concurrency.")

    @contextmanager
    def lease(self) -> Iterator[UidLease]:
        slot = self._take()
        lease = UidLease(process_uid_base() + slot)
        try:
            yield lease
        finally:
            usable_from = time.monotonic() + (self.REUSE_AFTER if lease.killed else 0.0)
            with self._lock:
                self._free.append((slot, usable_from))


PROCESS_UID_SLOTS = UidSlots()
