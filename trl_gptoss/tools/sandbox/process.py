"""The weaker, explicitly chosen isolation (``isolation="process"``): no namespaces, no file-system view.

``init.py`` runs as the host's user in a new session/process group inside a private working directory:
it joins the call's cgroups, sets the rlimits, drops to the per-call uid when the host is root, blocks the
``socket`` constructors at the Python level (bypassable: ctypes, or exec of another binary) and runs the
code. The code can read every file its uid can read (the repository, the training data) and reach the
network; a daemon that leaves the process group is found by a per-call marker in its environment and killed.
Use it only where user namespaces cannot be enabled.
"""

from __future__ import annotations

import os
import signal
import subprocess

from trl_gptoss.tools.sandbox.init import MAIN, CallConfig
from trl_gptoss.tools.sandbox.limits import SandboxLimits
from trl_gptoss.tools.sandbox.view import INIT_HOST

MARKER_VAR = "TRL_GPTOSS_SANDBOX_CALL"


def launch(
    source: bytes,
    python: str,
    limits: SandboxLimits,
    env: dict[str, str],
    uid: int | None,
    cgroup_procs: list[str],
    call_dir: str,
) -> subprocess.Popen:
    """Start the call in ``call_dir/work``; ``uid``: the per-call uid to drop to (root hosts) or ``None``."""
    workdir = os.path.join(call_dir, "work")
    os.mkdir(workdir, 0o700)
    with open(os.path.join(workdir, MAIN), "wb") as f:
        f.write(source)
    if uid is not None:
        os.chmod(call_dir, 0o711)
        for path in (workdir, os.path.join(workdir, MAIN)):
            os.chown(path, uid, uid)
    config = CallConfig(
        cpu_seconds=limits.cpu_seconds,
        address_space_bytes=limits.address_space_bytes,
        file_size_bytes=limits.file_size_bytes,
        open_files=limits.open_files,
        nproc=limits.max_processes + (0 if uid is not None else _count_own_processes()),
        uid=uid if uid is not None else -1,
        block_sockets=True,
        release_fd=-1,
        cgroup_procs=cgroup_procs,
    )
    return subprocess.Popen(
        [python, "-I", "-u", INIT_HOST, *config.to_argv()],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=workdir,
        env=env,
        start_new_session=True,
    )


def first_closed_ancestor(path: str) -> str | None:
    """The outermost ancestor of ``path`` that other users may not traverse (no ``o+x``), if any."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def check_reachable_by_others(python: str) -> None:
    """As root the code runs under a per-call uid, which must be able to read the interpreter's files."""
    for path in (python, os.path.realpath(python)):
        closed = first_closed_ancestor(path)
        if closed is not None:
            raise ValueError(
                f"python_executable={python!r} lives under {closed!r}, which the sandbox's unprivileged uid cannot "
                "enter; pass a world-readable interpreter (/usr/bin/python3) or use isolation='namespaces'."
            )


def _count_own_processes() -> int:
    """Processes of this uid right now; RLIMIT_NPROC counts them all when we cannot switch uid."""
    me = os.getuid()
    count = 0
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == me:
                count += 1
        except OSError:
            continue
    return count


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
