"""Start one call under bubblewrap: the namespaces, the allow-listed view, seccomp, and ``init.py``.

``bwrap`` gets its options through a pipe (``--args FD``): its command line, which every process of the call
can read as ``/proc/1/cmdline``, is just ``bwrap --args N PYTHON -I -u /.sandbox/init.py KEY=VALUE...`` —
no host paths beyond the interpreter, no pids, no cgroup names. The code arrives through a memfd copied to
``/tmp/work/main.py``, ``init.py`` likewise to ``/.sandbox/init.py`` (a bind would show the repository's path
in ``/proc/self/mountinfo``); the seccomp program through a pipe. Namespaces: user (see ``userns.py``), mount,
PID (bubblewrap's PID 1 reaps, and when it dies the kernel kills every process of the call), network (its own loopback,
up, and no other interface: the call's processes reach each other over 127.0.0.1, nothing else; no
abstract unix sockets of the host), IPC (no host SysV
shared memory; segments die with the call), UTS and cgroup. ``--die-with-parent`` ends the call if the
host process dies, ``--new-session`` detaches it from any terminal.

A host killed while bubblewrap starts can still leave one process behind: bubblewrap arms
``--die-with-parent`` in its outer process before it lets its child (the sandbox's PID 1) go on, so the outer
one can die in between, and the child then waits for it forever (on an eventfd, which never reports a closed
writer), outside every cgroup, before running anything. ``reap_orphans`` (every new ``PythonSandbox``) kills
such a process: this bubblewrap binary, PID 1 of its PID namespace, whose parent is no longer bubblewrap. A host
killed later is covered by ``--die-with-parent``, and one killed before its release by ``init.py`` (step 0).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess

from trl_gptoss.tools.sandbox.init import CallConfig
from trl_gptoss.tools.sandbox.limits import SandboxLimits
from trl_gptoss.tools.sandbox.userns import PROCESS_USER_NAMESPACES, SANDBOX_UID
from trl_gptoss.tools.sandbox.view import DATA_DIR, INIT_HOST, INIT_INSIDE, WORKDIR, HostView, bwrap_path

NAMESPACES = ("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try")
# GPT-OSS's builtin python description promises a drive at /mnt/data; within a conversation its files
# persist because the rollout's PythonSession replays earlier cells.
SCRATCH_TARGETS = ("/tmp", "/dev/shm", DATA_DIR)


@functools.lru_cache(maxsize=1)
def _init_source() -> bytes:
    with open(INIT_HOST, "rb") as f:
        return f.read()


def _pipe_with(data: bytes) -> int:
    """A pipe's read end already holding ``data`` (which must fit the pipe buffer) and EOF."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, data)
    finally:
        os.close(write_end)
    return read_end


def _memfd_with(data: bytes) -> int:
    fd = os.memfd_create("main.py", os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def launch(
    source: bytes,
    view: HostView,
    limits: SandboxLimits,
    env: dict[str, str],
    host_uid: int | None,
    cgroup_procs: list[str],
    seccomp_filter: bytes | None,
    scratch_binds: list[str] | None = None,
) -> subprocess.Popen:
    """Start the call; stdout/stderr are pipes, stdin is ``/dev/null``. ``host_uid``: the unprivileged host uid
    the code runs as (root hosts), or ``None`` to let bubblewrap map the host's own uid (non-root hosts).
    ``scratch_binds``: ``--bind`` arguments of host-mounted, inode-capped tmpfs for ``SCRATCH_TARGETS``
    (``scratch.py``); ``None``: bubblewrap's own ``--tmpfs`` (size only).

    The call joins ``cgroup_procs`` from the host while bubblewrap sets up its mounts: bubblewrap reports its
    child's pid (``--info-fd``) right after creating the namespaces and waits (``--block-fd``) before it forks
    the interpreter, so both of its processes, and every process the call starts later, are in the groups
    before any model-written code runs, and no cgroup file is ever visible inside."""
    fds: list[int] = []
    info_read, info_write = os.pipe()
    block_read, block_write = os.pipe()
    fds += [info_write, block_read]
    try:
        code_fd = _memfd_with(source)
        fds.append(code_fd)
        args = [*NAMESPACES, "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
        for key, value in env.items():
            args += ["--setenv", key, value]
        if host_uid is not None:
            fds.append(os.dup(PROCESS_USER_NAMESPACES.fd_for(host_uid)))
            # Set up as the namespace's root (kuid 0), which init.py leaves for SANDBOX_UID.
            args += ["--userns", str(fds[-1]), "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            args += ["--unshare-user"]
        # Scratch first: the view's read-only binds may live under /tmp (a virtualenv there) and must stay on top.
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--perms", "0755", "--dir", os.path.dirname(DATA_DIR)]  # bubblewrap would make /mnt 0700
        if scratch_binds is not None:
            args += scratch_binds
        else:
            for target in SCRATCH_TARGETS:
                args += ["--size", str(limits.disk_bytes), "--perms", "1777", "--tmpfs", target]
        args += list(view.args)
        fds.append(_memfd_with(_init_source()))
        args += ["--perms", "0755", "--dir", os.path.dirname(INIT_INSIDE), "--perms", "0444", "--file", str(fds[-1])]
        args += [INIT_INSIDE]
        args += ["--perms", "0777", "--dir", WORKDIR, "--perms", "0444", "--file", str(code_fd), f"{WORKDIR}/main.py"]
        args += ["--chdir", WORKDIR, "--info-fd", str(info_write), "--block-fd", str(block_read)]
        if seccomp_filter is not None:
            fds.append(_pipe_with(seccomp_filter))
            args += ["--seccomp", str(fds[-1])]
        args_fd = _pipe_with(b"".join(a.encode() + b"\0" for a in args))
        release_fd = os.dup(block_read)  # init.py's copy of the release pipe (init.py, step 0)
        fds += [args_fd, release_fd]
        config = CallConfig(
            cpu_seconds=limits.cpu_seconds,
            address_space_bytes=limits.address_space_bytes,
            file_size_bytes=limits.file_size_bytes,
            open_files=limits.open_files,
            nproc=limits.max_processes + 1,  # + bubblewrap's PID 1 when it shares the uid (non-root hosts)
            uid=SANDBOX_UID if host_uid is not None else -1,
            block_sockets=False,
            release_fd=release_fd,
            cgroup_procs=(),
        )
        argv = ["bwrap", "--args", str(args_fd), view.python, "-I", "-u", INIT_INSIDE, *config.to_argv()]
        proc = subprocess.Popen(
            argv,
            executable=bwrap_path(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=fds,
            env={},
            cwd="/",
            start_new_session=True,
        )
    except BaseException:
        os.close(block_write)
        os.close(info_read)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    _join_then_release(proc, info_read, block_write, cgroup_procs)
    return proc


def _status(pid: str) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _exe(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:  # gone, a kernel thread, or not ours to read
        return None


def reap_orphans() -> int:
    """SIGKILL every sandbox PID 1 of this user whose bubblewrap parent is gone (see the module docstring)."""
    binary = os.path.realpath(bwrap_path())
    killed = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or _exe(pid) != binary:
            continue
        try:
            status = _status(pid)
            namespace_pids = status["NSpid"].split()
            if int(status["Uid"].split()[1]) != os.geteuid() or len(namespace_pids) < 2 or namespace_pids[-1] != "1":
                continue  # another user's process, or bubblewrap's outer process
            if _exe(status["PPid"]) == binary:
                continue  # its bubblewrap parent is alive: a call running or starting
            os.kill(int(pid), signal.SIGKILL)
            killed += 1
        except (OSError, KeyError, ValueError, IndexError):  # gone meanwhile
            continue
    return killed


def _join_then_release(proc: subprocess.Popen, info_read: int, block_write: int, cgroup_procs: list[str]) -> None:
    """Move bubblewrap's two processes into the call's cgroups, then release the call: ``go``, of which
    bubblewrap reads the ``g`` and ``init.py`` the ``o``. If that fails, both are killed before the interpreter
    exists; if this process dies first, the pipe closes, bubblewrap goes on, and ``init.py`` exits at once."""
    child = None
    try:
        with os.fdopen(info_read, "rb") as info:
            report = info.read()  # EOF once bubblewrap wrote it (or died)
        if report:
            child = json.loads(report)["child-pid"]
            for path in cgroup_procs:
                for pid in (proc.pid, child):
                    with open(path, "w") as f:
                        f.write(str(pid))
        os.write(block_write, b"go")
    except BaseException:
        for pid in (child, proc.pid):
            with contextlib.suppress(OSError, TypeError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        os.close(block_write)
