"""Process helpers of the servers this package starts: is a pid alive, who is left in a process group, and a
child that dies with its parent. Standard library only."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts: signalling it is refused, not missed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group ``pgid`` that are still running (zombies waiting to be reaped do not count)."""
    members = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(stat_file.parent.name))
    return members


def _die_with_parent():
    """A ``preexec_fn`` giving the child SIGKILL when its parent dies, or ``None`` off the main thread.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked exits; the main thread lives as long as the
    process, any other may not, so only there is it the process's death. The child calls a function pointer
    resolved here, before the fork (no dlopen, no lock taken between fork and exec).
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)

    return preexec
