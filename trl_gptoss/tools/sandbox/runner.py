"""``PythonSandbox``: run model-written Python in a fresh, limited, isolated process tree per call.

The code is hostile input running on the training host. Each call: its own namespaces and allow-listed file
system (``bwrap.py``, ``view.py``), a seccomp filter (``seccomp.py``), cgroups for memory, processes and CPU
(``cgroups.py``), rlimits and an unprivileged uid (``init.py``, ``userns.py``), an empty environment, output
read incrementally with a cap, a wall clock, and at the end every process of the call is killed. A call is a
fork of the sandbox's zygote (``preforked.py``, ``zygote.py``) where the host supports one, else a bubblewrap
of its own (``bwrap.py``).
``process.py`` is the weaker level for hosts without user namespaces. ``docs/tools_and_rewards.md`` states
what the code can and cannot see or touch, and the measured cost.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

from trl_gptoss.tools.result import ToolResult, clean_output
from trl_gptoss.tools.sandbox import bwrap, cgroups, preforked, process, scratch, userns
from trl_gptoss.tools.sandbox.limits import SandboxLimits
from trl_gptoss.tools.sandbox.seccomp import build_filter
from trl_gptoss.tools.sandbox.view import DEFAULT_PACKAGES, WORKDIR, host_view

ISOLATIONS = ("auto", "namespaces", "process")
_BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": WORKDIR,
    "PYTHONDONTWRITEBYTECODE": "1",
    # BLAS/OpenMP pools reserve address space per thread; one thread keeps numpy inside RLIMIT_AS.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_READ_CHUNK = 65536
CALL_DIR_PREFIX = "trl-gptoss-sandbox-"  # + pid: each process can tell its own leftovers (process isolation)
_POLL_INTERVAL = 0.05  # how often the reader checks whether the program exited
_EXIT_GRACE = 0.2


def detect_isolation() -> str:
    """The strongest isolation this host offers: ``"namespaces"`` (user namespaces work) or ``"process"``."""
    return "namespaces" if userns.user_namespace_problem() is None else "process"


class PythonSandbox:
    """Runs Python source in a sandbox; thread-safe. At most ``max_concurrency`` calls of this sandbox run at
    once, however they are started (``run`` from many threads, ``run_many``, ``run_tool_calls``).

    Args:
        limits: ``SandboxLimits`` for every call.
        isolation: ``"auto"``/``"namespaces"`` (bubblewrap; raises at construction, saying how to enable user
            namespaces, when the host forbids them) or ``"process"`` (weaker, explicit opt-in).
        python_executable: interpreter for the code (default: this one, so numpy/sympy are importable).
        max_concurrency: calls running at once (each is a process tree; keep it near the core count
            times 2-4: calls mostly wait on start-up).
        packages: top-level packages the code may import besides the standard library (namespace isolation;
            missing ones are listed in ``missing_packages``).
        seccomp: install the seccomp filter (namespace isolation).
        zygote: run calls through a pre-forked interpreter (``preforked.py``, ``zygote.py``): one long-lived
            bubblewrap per sandbox whose zygote forks each call into its own PID, mount, IPC and network
            namespaces, tmpfs, cgroups, rlimits, uid and seccomp filter. ``None`` (default): where the host
            supports it (``zygote_problem``), falling back to a bubblewrap per call if it cannot start;
            ``True``: required (``ValueError`` where unsupported); ``False``: a bubblewrap per call.
        preload: packages the zygote imports once, so calls find them imported (those of ``packages`` only).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        isolation: str = "auto",
        python_executable: str | None = None,
        max_concurrency: int = 8,
        packages: tuple[str, ...] = DEFAULT_PACKAGES,
        seccomp: bool = True,
        zygote: bool | None = None,
        preload: tuple[str, ...] = ("numpy",),
    ):
        self.limits = limits if limits is not None else SandboxLimits()
        if not isinstance(self.limits, SandboxLimits):
            raise ValueError(f"limits must be a SandboxLimits, got {type(self.limits).__name__}.")
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}.")
        if not 1 <= max_concurrency <= userns.SLOTS_PER_PROCESS:
            raise ValueError(f"max_concurrency must be in [1, {userns.SLOTS_PER_PROCESS}], got {max_concurrency}.")
        self.max_concurrency = max_concurrency
        self._running = threading.BoundedSemaphore(max_concurrency)
        self.python = os.path.abspath(python_executable or sys.executable)
        if isinstance(packages, str) or not all(isinstance(p, str) and p.isidentifier() for p in packages):
            raise ValueError(f"packages must be a tuple of top-level module names, got {packages!r}.")
        self.isolation = "process" if isolation == "process" else "namespaces"
        self._is_root = os.geteuid() == 0
        if self.isolation == "namespaces":
            problem = userns.user_namespace_problem()
            if problem is not None:
                raise userns.UserNamespaceError(userns.USERNS_HELP.format(reason=problem))
            self._view = host_view(self.python, tuple(packages))
            self.missing_packages = self._view.missing_packages
            self._seccomp = build_filter() if seccomp else None
            # disk_files (nr_inodes) needs tmpfs mounted by this process (scratch.py); else size only.
            self.disk_files_capped = scratch.host_can_mount()
            if self.disk_files_capped:
                scratch.reap_dead_staging()
            bwrap.reap_orphans()  # a bubblewrap a killed host left waiting
        else:
            self.missing_packages = ()
            self.disk_files_capped = False
            if self._is_root:
                process.check_reachable_by_others(self.python)
        self._zygote = self._make_zygote(zygote, tuple(preload))
        self.zygote = self._zygote is not None
        self.cgroups = cgroups.cgroup_layout()  # "v1", "v2" or None: whole-call memory/process caps
        self.cpu_quota = self.cgroups is not None and cgroups.has_cpu_quota()
        if self.cgroups is not None:
            cgroups.reap(foreign=True)  # groups a killed host left behind

    def _make_zygote(self, wanted: bool | None, preload: tuple[str, ...]) -> preforked.Zygote | None:
        self._zygote_required = wanted is True
        if wanted is False:
            return None
        problem = "it needs isolation='namespaces'" if self.isolation != "namespaces" else None
        problem = problem or preforked.zygote_problem(self._view)
        if problem is not None:
            if wanted:
                raise ValueError(f"zygote=True cannot be used here: {problem}; use zygote=False or None.")
            return None
        self.disk_files_capped = True  # each call mounts its own tmpfs, inode cap included
        zygote = preforked.Zygote(self._view, self.limits, _BASE_ENV, self._seccomp, preload)
        weakref.finalize(self, zygote.close)  # also at interpreter exit
        return zygote

    def close(self) -> None:
        """End the zygote, if one runs (calls keep working: a later call starts a new one)."""
        if self._zygote is not None:
            self._zygote.close()

    def run(self, code: str) -> ToolResult:
        """Run ``code`` as ``main.py`` in a fresh sandbox and return what it printed and how it ended."""
        if not isinstance(code, str):
            raise ValueError(f"code must be a str of Python source, got {type(code).__name__}.")
        # A lone surrogate cannot be UTF-8; pass it through so the interpreter reports it as a SyntaxError.
        source = code.encode("utf-8", "surrogatepass")
        if len(source) > self.max_code_bytes:
            return self._refused(
                f"the program is {len(source):,} bytes, over the {self.max_code_bytes:,} a call accepts (half of "
                "its /tmp, SandboxLimits.disk_bytes); it was not run"
            )
        with self._running:
            return self._run(source)

    @property
    def max_code_bytes(self) -> int:
        """The largest program a call runs: it is copied into the call's ``/tmp`` (``disk_bytes``), which
        must keep room for the program's own files."""
        return self.limits.disk_bytes // 2

    def _refused(self, notice: str) -> ToolResult:
        return ToolResult("", "", None, False, False, 0.0, self.isolation, notice)

    def run_many(self, codes: list[str]) -> list[ToolResult]:
        """Run several programs concurrently (``run`` bounds them to ``max_concurrency``); results in order."""
        codes = list(codes)
        if not codes:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(codes))) as pool:
            return list(pool.map(self.run, codes))

    def _run(self, source: bytes) -> ToolResult:
        start = time.monotonic()
        marker = uuid.uuid4().hex
        limits = self.limits
        with (
            userns.PROCESS_UID_SLOTS.lease() as lease,
            cgroups.call_cgroups(marker, limits.memory_bytes, limits.max_processes, limits.cpu_cores) as procs,
            self._call_dir() as call_dir,
            self._scratch() as mounts,
        ):
            proc = self._launch(source, lease.uid if self._is_root else None, procs, marker, call_dir, mounts)
            truncated = timed_out = True  # until _collect says otherwise (it may raise)
            try:
                out, err, truncated, timed_out = _collect(proc, start + limits.wall_seconds, limits.output_bytes)
            finally:
                lease.killed = truncated or timed_out
                _kill_group(proc)
                if self.isolation == "process":
                    process.kill_marked(marker)
        return ToolResult(
            stdout=clean_output(out),
            stderr=clean_output(err),
            exit_code=self._exit_code(proc.returncode, timed_out or truncated),
            timed_out=timed_out,
            truncated=truncated,
            wall_time=time.monotonic() - start,
            isolation=self.isolation,
        )

    @contextlib.contextmanager
    def _call_dir(self):
        """Process isolation's private host directory (namespace isolation keeps everything in its tmpfs)."""
        if self.isolation != "process":
            yield None
            return
        call_dir = tempfile.mkdtemp(prefix=f"{CALL_DIR_PREFIX}{os.getpid()}-")
        try:
            yield call_dir
        finally:
            shutil.rmtree(call_dir, ignore_errors=True)

    @contextlib.contextmanager
    def _scratch(self):
        """The call's inode-capped tmpfs, mounted by this process (``None``: bubblewrap's ``--tmpfs``)."""
        if self.isolation != "namespaces" or not self.disk_files_capped or self._zygote is not None:
            yield None
            return
        mounts = scratch.Scratch(bwrap.SCRATCH_TARGETS, self.limits.disk_bytes, self.limits.disk_files)
        try:
            yield mounts
        finally:
            mounts.remove()

    def _launch(self, source, uid, procs, marker, call_dir, mounts) -> subprocess.Popen | preforked.ZygoteCall:
        zygote = self._zygote  # once: another call may fall back meanwhile
        if zygote is not None:
            try:
                return zygote.spawn(source, uid, procs)
            except preforked.ZygoteError as exc:
                if self._zygote_required:
                    raise
                warnings.warn(f"{exc}; this sandbox runs each call under its own bubblewrap from now on", stacklevel=4)
                zygote.close()
                self._zygote, self.zygote = None, False
                self.disk_files_capped = scratch.host_can_mount()
        if self.isolation == "namespaces":
            binds = mounts.binds if mounts is not None else None
            proc = bwrap.launch(source, self._view, self.limits, _BASE_ENV, uid, procs, self._seccomp, binds)
            if mounts is not None:
                mounts.unmount()  # bubblewrap's namespace has its own copies; their directories stay until the end
            return proc
        env = {**_BASE_ENV, "HOME": call_dir, process.MARKER_VAR: marker}
        return process.launch(source, self.python, self.limits, env, uid, procs, call_dir)

    def _exit_code(self, returncode: int | None, killed_by_us: bool) -> int | None:
        if returncode is None:
            return None
        if self.isolation == "namespaces" and 128 < returncode < 128 + 65 and not killed_by_us:
            return -(returncode - 128)  # bubblewrap's PID 1 reports a signal N as 128 + N
        return returncode


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr until both close and the program ends, ``deadline`` passes or ``cap`` bytes arrive.

    Returns ``(stdout, stderr, truncated, timed_out)``; the caller then kills the process group, so a
    writer of 100 MB costs ``cap`` bytes of memory, not 100 MB. Once the launched process has exited we
    drain for at most ``_EXIT_GRACE`` seconds: a daemon it left holding the pipes must not stall the call.
    """
    chunks = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    total, truncated, timed_out, exited_at = 0, False, False, None
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _EXIT_GRACE:
                break
            if now >= deadline:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(deadline - now, _POLL_INTERVAL)):
                data = os.read(key.fd, _READ_CHUNK)
                if not data:
                    sel.unregister(key.fd)
                    continue
                chunks[key.fd].append(data[: max(cap - total, 0)])
                total += len(data)
                truncated = truncated or total > cap
            if truncated:
                break
    proc.stdout.close()
    proc.stderr.close()
    if not (truncated or timed_out):
        # Both pipes closed; a program that closed them itself may still be running: give it the clock.
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            timed_out = True
    out, err = (b"".join(c) for c in chunks.values())
    return out, err, truncated, timed_out


def _kill_group(proc: subprocess.Popen | preforked.ZygoteCall) -> None:
    """SIGKILL the call's process group. Under bubblewrap that is its host-side process; its PID 1 then gets
    ``PDEATHSIG`` (``--die-with-parent``) and the kernel kills the whole PID namespace. A zygote's call: the
    zygote kills its PID 1 and reports once the whole PID namespace is gone."""
    if isinstance(proc, preforked.ZygoteCall):
        proc.kill()
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
