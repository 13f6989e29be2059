"""Watchdog of a vLLM server: when the process that started the server dies, however it died (SIGKILL
included), kill the server's whole process group and remove the files it leaves behind.

Run with the standard library only: ``python -I -S server_watchdog.py PARENT_PID PIDFD PGID [PATH ...]``, started
by ``VLLMServer.start`` with a pipe on stdin and ``PIDFD`` (a pidfd of the parent, -1 where the kernel has
none) inherited. It detaches at once (a second fork; the first child exits), so it is neither a child of the
parent nor in its process group or session: nothing sent to the parent's job reaches it. Then it waits for
either ``stop`` on stdin (``VLLMServer.stop`` is cleaning up itself: exit) or the parent's death (the pidfd
becomes readable, or stdin reaches end-of-file) -- then SIGTERM to the group, SIGKILL after ``GRACE_S``, and
each PATH deleted (files and directories).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import time

GRACE_S = 5.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parent_died(parent: int, pidfd: int) -> bool:
    """Block until ``stop`` arrives on stdin (False) or ``parent`` is gone (True)."""
    watched = [0] if pidfd < 0 else [0, pidfd]
    while True:
        ready, _, _ = select.select(watched, [], [], None if pidfd >= 0 else 0.5)
        if 0 in ready:
            return not os.read(0, 64).startswith(b"stop")  # b"": end-of-file, the parent is gone
        if pidfd in ready or (pidfd < 0 and not _alive(parent)):
            return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(pgid: int) -> None:
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def main(argv: list[str]) -> int:
    parent, pidfd, pgid, *paths = argv
    if os.fork():  # detach: the first child exits, its child (re-parented to init) watches
        os._exit(0)
    os.setsid()
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):  # the job's signals are not for the watchdog
        signal.signal(sig, signal.SIG_IGN)
    if not _parent_died(int(parent), int(pidfd)):
        return 0
    _kill_group(int(pgid))
    for path in paths:
        _remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
