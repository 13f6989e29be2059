"""The host's side of the zygote (``zygote.py``): one long-lived bubblewrap per ``PythonSandbox`` that forks calls.

``Zygote.spawn`` sends one request per call over the zygote's control socket (``SOCK_SEQPACKET``): the call's
in-sandbox uid as JSON and, by ``SCM_RIGHTS``, the call's own socket, the write ends of its stdout/stderr
pipes, a memfd holding the code and the opened ``cgroup.procs`` of its cgroups. It returns a ``ZygoteCall``,
which quacks like the ``subprocess.Popen`` of a per-call bubblewrap (``stdout``, ``stderr``, ``poll``,
``wait``, ``returncode``), so the runner reads and times both alike; ``ZygoteCall.kill`` asks the zygote to
SIGKILL the call's PID 1 and waits for its exit status, which the zygote sends only once it has reaped that
PID 1, i.e. once every process of the call is gone.

The zygote's bubblewrap has the per-call launcher's namespaces, view and ``--die-with-parent``; it is started
lazily, restarted when it died, and ended by ``close()`` (or when this process exits: end-of-file on the
control socket ends the zygote, and ``--die-with-parent`` its bubblewrap).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import signal
import socket
import subprocess
import threading

from trl_gptoss.tools.sandbox import userns
from trl_gptoss.tools.sandbox.bwrap import NAMESPACES, SCRATCH_TARGETS, _memfd_with, _pipe_with
from trl_gptoss.tools.sandbox.init import CallConfig
from trl_gptoss.tools.sandbox.limits import SandboxLimits
from trl_gptoss.tools.sandbox.view import _DEST_ARITY, DATA_DIR, INIT_HOST, INIT_INSIDE, WORKDIR, HostView, bwrap_path

ZYGOTE_HOST = os.path.join(os.path.dirname(INIT_HOST), "zygote.py")
ZYGOTE_INSIDE = os.path.join(os.path.dirname(INIT_INSIDE), "zygote.py")
# The capabilities the zygote keeps in its user namespace (never on the host): new namespaces and mounts per
# call, the call's loopback, and the uid switch. The program loses them all when it leaves uid 0.
CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SETUID", "CAP_SETGID")
START_TIMEOUT = 60.0  # seconds for the zygote to import its preloaded packages (a loaded host is slow)
KILL_TIMEOUT = 5.0  # seconds for the zygote to confirm a killed call is gone before the zygote is restarted


class ZygoteError(RuntimeError):
    """The zygote could not start (or died while starting)."""


def zygote_problem(view: HostView) -> str | None:
    """``None`` when calls can run through a zygote on this host, else why not."""
    if os.geteuid() != 0:
        return "the zygote maps a range of host uids into its user namespace, which needs a root host process"
    if not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        return "the zygote needs Python >= 3.9 (os.pidfd_open, socket.send_fds)"
    for _op, operands in _view_operations(view):
        dest = operands[-1]
        if dest == WORKDIR or dest.startswith(WORKDIR + "/"):
            return f"the interpreter or a package lives under {dest}, the working directory every call creates"
    return None


def _view_operations(view: HostView):
    """``(op, operands)`` of each bubblewrap operation of ``view``, in order (``--perms`` skipped)."""
    args, i = view.args, 0
    while i < len(args):
        if args[i] == "--perms":
            i += 2
            continue
        arity = _DEST_ARITY[args[i]]
        yield args[i], args[i + 1 : i + arity + 1]
        i += arity + 1


def kept_under_scratch(view: HostView) -> dict[str, list[list[str]]]:
    """What each call must rebuild on top of its fresh scratch tmpfs so that the view's paths beneath a scratch
    target (an interpreter or virtualenv under ``/tmp``) stay visible: per target, in the view's order,
    ``["dir", DEST]``, ``["symlink", TARGET, DEST]`` or ``["mount", DEST]`` (a read-only bind or tmpfs of the view,
    re-bound from the zygote's own, submounts included, so nothing beneath a ``mount`` is listed again)."""
    kept: dict[str, list[list[str]]] = {}
    for op, operands in _view_operations(view):
        dest = operands[-1]
        target = next((t for t in SCRATCH_TARGETS if dest.startswith(t + "/")), None)
        if target is None:
            continue
        entries = kept.setdefault(target, [])
        if any(e[0] == "mount" and dest.startswith(e[-1] + "/") for e in entries):
            continue
        if op == "--dir":
            entries.append(["dir", dest])
        elif op == "--symlink":
            entries.append(["symlink", operands[0], dest])
        else:  # --ro-bind, --tmpfs
            entries.append(["mount", dest])
    return kept


def _readable(files: list, timeout: float | None) -> list:
    """Those of ``files`` that are readable within ``timeout`` seconds (``poll``: descriptors may be > 1024)."""
    poller = select.poll()
    by_fd = {f.fileno(): f for f in files}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    events = poller.poll(None if timeout is None else max(timeout, 0) * 1000)
    return [by_fd[fd] for fd, _ in events]


@contextlib.contextmanager
def _closing(fds: list[int]):
    try:
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


class _LauncherThread:
    """Runs the zygotes' ``Popen`` in one long-lived daemon thread. ``--die-with-parent`` is
    ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked bubblewrap ends: a zygote started from a
    short-lived worker thread (``run_many``'s pool) would be killed when that thread ends."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._owner = None

    def call(self, function, *args):
        with self._lock:
            if self._thread is None or self._owner != os.getpid() or not self._thread.is_alive():
                self._jobs, self._owner = queue.SimpleQueue(), os.getpid()
                self._thread = threading.Thread(target=self._serve, args=(self._jobs,), daemon=True)
                self._thread.start()
        answer: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((function, args, answer))
        ok, value = answer.get()
        if not ok:
            raise value
        return value

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            function, args, answer = jobs.get()
            try:
                answer.put((True, function(*args)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                answer.put((False, exc))


_LAUNCHER = _LauncherThread()


class Zygote:
    """One sandbox's zygote: ``spawn`` a call; thread-safe; started on the first call, restarted when dead."""

    def __init__(self, view: HostView, limits: SandboxLimits, env: dict[str, str], seccomp_filter, preload):
        self.view, self.limits, self.env = view, limits, env
        self.seccomp_filter = seccomp_filter
        self.preload = tuple(p for p in preload if p in view.packages)
        self.starts = 0  # how many zygotes this object started (restarts included)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._owner = os.getpid()  # a forked child of this process must not use (or kill) the parent's zygote

    @property
    def pid(self) -> int | None:
        """Host pid of the zygote's (outer) bubblewrap, while one runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def spawn(self, source: bytes, host_uid: int, cgroup_procs: list[str]) -> ZygoteCall:
        """Start one call running ``source`` as host uid ``host_uid`` (one of this process's uid slots)."""
        slot = host_uid - userns.process_uid_base()
        if not 0 <= slot < userns.SLOTS_PER_PROCESS:
            raise ValueError(f"host uid {host_uid} is not one of this process's sandbox uids")
        call, call_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            with call_end, _closing([out_write, err_write, _memfd_with(source)]) as fds:
                fds += [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in cgroup_procs]
                request = json.dumps({"uid": userns.SANDBOX_UID + slot}).encode()
                proc = self._send(request, [call_end.fileno(), *fds])
        except BaseException:
            for fd in (out_read, err_read):
                os.close(fd)
            call.close()
            raise
        return ZygoteCall(call, out_read, err_read, self, proc)

    def _send(self, request: bytes, fds: list[int]) -> subprocess.Popen:
        """Send one request; returns the zygote's bubblewrap that got it."""
        with self._lock:
            for attempt in range(2):  # a zygote that died since the last call is replaced once
                control = self._running()
                try:
                    socket.send_fds(control, [request], fds)
                    return self._proc
                except OSError:
                    if attempt:
                        raise
                    self._stop()

    def _running(self) -> socket.socket:
        if self._owner != os.getpid():  # forked: the zygote is the parent's; start our own
            self._proc, self._control, self._owner = None, None, os.getpid()
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._start()
        return self._control

    def _start(self) -> None:
        host_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = _LAUNCHER.call(self._launch, zygote_end.detach())
        except BaseException:
            host_end.close()
            raise
        self._proc, self._control = proc, host_end
        self.starts += 1
        ready = _readable([host_end, proc.stderr], START_TIMEOUT)
        if host_end in ready and host_end.recv(16) == b"ready":
            return
        self._stop()
        reason = proc.stderr.read().decode(errors="replace").strip()[-2000:] if proc.stderr in ready else "no answer"
        raise ZygoteError(f"the sandbox's zygote did not start: {reason or 'it exited'}")

    def _launch(self, control_fd: int) -> subprocess.Popen:
        """bubblewrap running ``zygote.py``, holding ``control_fd`` (closed here)."""
        namespace = userns.PROCESS_USER_NAMESPACES.fd_for(userns.process_uid_base(), userns.SLOTS_PER_PROCESS)
        with _closing([control_fd, os.dup(namespace)]) as fds:
            args = [*NAMESPACES, "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
            for key, value in self.env.items():
                args += ["--setenv", key, value]
            args += ["--userns", str(fds[-1])]
            for capability in CAPABILITIES:
                args += ["--cap-add", capability]
            args += ["--proc", "/proc", "--dev", "/dev", "--perms", "0755", "--dir", os.path.dirname(DATA_DIR)]
            for target in SCRATCH_TARGETS:  # mount points: each call mounts its own tmpfs there
                args += ["--perms", "0755", "--dir", target]
            args += list(self.view.args)
            args += ["--perms", "0755", "--dir", os.path.dirname(INIT_INSIDE)]
            for host_path, inside in ((INIT_HOST, INIT_INSIDE), (ZYGOTE_HOST, ZYGOTE_INSIDE)):
                with open(host_path, "rb") as f:
                    fds.append(_memfd_with(f.read()))
                args += ["--perms", "0444", "--file", str(fds[-1]), inside]
            args += ["--chdir", "/"]
            options = [f"control_fd={fds[0]}", f"disk_bytes={self.limits.disk_bytes}"]
            options += [f"disk_files={self.limits.disk_files}", f"workdir={WORKDIR}"]
            options += [f"scratch={t}" for t in SCRATCH_TARGETS] + [f"preload={p}" for p in self.preload]
            kept = kept_under_scratch(self.view)
            if kept:  # through a pipe, like the filter: the zygote's command line is /proc/1/cmdline of every call
                fds.append(_pipe_with(json.dumps(kept).encode()))
            options.append(f"kept_fd={fds[-1] if kept else -1}")
            if self.seccomp_filter is not None:
                fds.append(_pipe_with(self.seccomp_filter))
            options.append(f"seccomp_fd={fds[-1] if self.seccomp_filter is not None else -1}")
            fds.append(_pipe_with(b"".join(a.encode() + b"\0" for a in args)))
            limits = self.limits
            config = CallConfig(
                cpu_seconds=limits.cpu_seconds,
                address_space_bytes=limits.address_space_bytes,
                file_size_bytes=limits.file_size_bytes,
                open_files=limits.open_files,
                nproc=limits.max_processes,  # the program's uid is the call's own: it counts only the call
                uid=-1,  # per call
                block_sockets=False,
                release_fd=-1,
                cgroup_procs=(),
            )
            argv = ["bwrap", "--args", str(fds[-1]), self.view.python, "-I", "-u", ZYGOTE_INSIDE]
            argv += [*config.to_argv(), "--", *options]
            proc = subprocess.Popen(
                argv,
                executable=bwrap_path(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=fds,
                env={},
                cwd="/",
                start_new_session=True,
            )
        return proc

    def _stop(self) -> None:
        """End the zygote and every call it runs (its bubblewrap's PID 1 takes the PID namespace down)."""
        proc, control = self._proc, self._control
        self._proc = self._control = None
        if control is not None:
            control.close()
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stderr.close()

    def restart(self, proc: subprocess.Popen | None = None) -> None:
        """End the zygote now (a later call starts a fresh one); with ``proc``, only if that is still the one
        running (a call that found its zygote dead must not end the replacement another call started)."""
        with self._lock:
            if self._owner == os.getpid() and (proc is None or proc is self._proc):
                self._stop()

    def close(self) -> None:
        """End the zygote and the calls it runs."""
        self.restart()


class ZygoteCall:
    """One call of the zygote, with the part of the ``subprocess.Popen`` interface the runner uses."""

    def __init__(self, call: socket.socket, out_read: int, err_read: int, zygote: Zygote, proc: subprocess.Popen):
        self._call, self._zygote, self._proc = call, zygote, proc
        self.stdout = open(out_read, "rb", buffering=0)  # noqa: SIM115 - closed by the reader
        self.stderr = open(err_read, "rb", buffering=0)  # noqa: SIM115 - closed by the reader
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._receive(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired("sandbox call", timeout)
        return self.returncode

    def _receive(self, timeout: float | None) -> None:
        if not _readable([self._call], timeout):
            return
        try:
            message = self._call.recv(64)
        except OSError:  # reset: the zygote died with our request unread
            message = b""
        if message.startswith(b"x"):
            self.returncode = int(message[1:])
        else:  # end-of-file: the zygote died, and its bubblewrap takes the call down with it
            self._zygote.restart(self._proc)
            self.returncode = -signal.SIGKILL

    def kill(self) -> None:
        """SIGKILL the call's PID 1 (so every process of the call) unless the call already reported its end, and
        wait for that report: the program and everything it started are gone then."""
        if self.returncode is None:
            with contextlib.suppress(OSError):  # the zygote already closed the socket: it is reporting
                self._call.send(b"k")
            try:
                self.wait(KILL_TIMEOUT)
            except subprocess.TimeoutExpired:  # a zygote that does not answer is replaced, calls and all
                self._zygote.restart(self._proc)
                self.returncode = -signal.SIGKILL
        self._call.close()
