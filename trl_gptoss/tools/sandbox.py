"""``PythonSandbox``: run model-written Python in a fresh, limited, isolated process per call.

The code is hostile input running on the training host. Each call: a new session/process group, rlimits
(``SandboxLimits``), an empty environment (only ``PATH``, ``LANG``, a few thread caps and a per-call
marker), a private working directory deleted afterwards, output read incrementally with a cap, a wall
clock, and at the end every process the call started is killed. See ``iso.py`` for the two
isolation levels and ``docs/tools_and_rewards.md`` for what this host offered and what was measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from trl_gptoss.tools import cgroups
from trl_gptoss.tools import isolation as iso
from trl_gptoss.tools.result import SandboxLimits, ToolResult

_INIT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_init.py")
_BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/tmp/work",
    "PYTHONDONTWRITEBYTECODE": "1",
    # BLAS/OpenMP pools reserve address space per thread; one thread keeps numpy inside RLIMIT_AS.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# Fallback isolation only: a Python-level socket block, then the program. Bypassable (ctypes, execve of
# another binary); documented as such. Namespace isolation needs no preamble: there is no network at all.
_SOCKET_BLOCK_PREAMBLE = """
import runpy, socket
def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in this sandbox")
socket.socket = socket.create_connection = socket.socketpair = socket.fromfd = _no_network
del socket, _no_network
runpy.run_path("main.py", run_name="__main__")
"""
_READ_CHUNK = 65536
CALL_DIR_PREFIX = "trl-gptoss-sandbox-"  # + pid: each process can tell its own leftovers
_POLL_INTERVAL = 0.05  # how often the reader checks whether the program exited
_EXIT_GRACE = 0.2


class PythonSandbox:
    """Runs Python source in a sandbox; thread-safe, and ``run_many`` runs a bounded pool of calls.

    Args:
        limits: ``SandboxLimits`` for every call.
        isolation: ``"auto"`` (namespaces when the host allows, else process), ``"namespaces"`` (error when
            unavailable) or ``"process"``.
        python_executable: interpreter for the code (default: this one, so numpy/sympy are importable).
        max_concurrency: calls running at once in ``run_many`` (each is a process tree, keep it near the
            core count times 2-4: calls mostly wait on start-up).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        isolation: str = "auto",
        python_executable: str | None = None,
        max_concurrency: int = 8,
    ):
        self.limits = limits if limits is not None else SandboxLimits()
        if not isinstance(self.limits, SandboxLimits):
            raise ValueError(f"limits must be a SandboxLimits, got {type(self.limits).__name__}.")
        self.isolation = _resolve_isolation(isolation)
        self.python = os.path.abspath(python_executable or sys.executable)
        if not 1 <= max_concurrency <= iso.SLOTS_PER_PROCESS:
            raise ValueError(
                f"max_concurrency must be in [1, {iso.SLOTS_PER_PROCESS}], got {max_concurrency}."
            )
        self.max_concurrency = max_concurrency
        self._uids = iso.PROCESS_UID_SLOTS
        self._hide_plan = iso.hide_plan(self.python) if self.isolation == "namespaces" else []
        self._is_root = os.geteuid() == 0
        if self.isolation == "process" and self._is_root:
            _check_reachable_by_others(self.python)
        self.cgroups = cgroups.cgroup_layout()  # "v1", "v2" or None: whole-call memory/process caps

    def run(self, code: str) -> ToolResult:
        """Run ``code`` as ``main.py`` in a fresh sandbox and return what it printed and how it ended."""
        if not isinstance(code, str):
            raise ValueError(f"code must be a str of Python source, got {type(code).__name__}.")
        start = time.monotonic()
        marker = uuid.uuid4().hex
        call_dir = tempfile.mkdtemp(prefix=f"{CALL_DIR_PREFIX}{os.getpid()}-")
        try:
            with (
                self._uids.uid() as uid,
                cgroups.call_cgroups(
                    marker, self.limits.memory_bytes, self.limits.max_processes
                ) as procs_paths,
            ):
                proc = self._launch(code, call_dir, uid, marker, procs_paths)
                try:
                    out, err, truncated, timed_out = _collect(
                        proc, start + self.limits.wall_seconds, self.limits.output_bytes
                    )
                finally:
                    _kill_group(proc)
                    iso.kill_marked(marker)
        finally:
            shutil.rmtree(call_dir, ignore_errors=True)
        return ToolResult(
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            exit_code=self._exit_code(proc.returncode, timed_out or truncated),
            timed_out=timed_out,
            truncated=truncated,
            wall_time=time.monotonic() - start,
            isolation=self.isolation,
        )

    def run_many(self, codes: list[str]) -> list[ToolResult]:
        """Run several programs concurrently (at most ``max_concurrency`` at once); results in order."""
        codes = list(codes)
        if not codes:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(codes))) as pool:
            return list(pool.map(self.run, codes))

    def _env(self, marker: str) -> dict[str, str]:
        return {**_BASE_ENV, iso.MARKER_VAR: marker}

    def _launch(self, code: str, call_dir: str, uid: int, marker: str, procs_paths=()) -> subprocess.Popen:
        if self.isolation == "namespaces":
            return self._launch_namespaced(code, call_dir, uid, marker, list(procs_paths))
        return self._launch_process(code, call_dir, uid, marker, list(procs_paths))

    def _launch_namespaced(self, code, call_dir, uid, marker, procs_paths):
        config = {
            "mode": "namespaces",
            "call_dir": call_dir,
            "uid": uid,
            "hide": self._hide_plan,
            "python": self.python,
            "python_dirs": list(iso.interpreter_dirs(self.python)),
            "env": self._env(marker),
            "limits": asdict(self.limits),
            "cgroup_procs": procs_paths,
        }
        argv = [shutil.which("unshare"), *iso.UNSHARE_FLAGS, *self._launcher(config)]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=call_dir,
            env={iso.MARKER_VAR: marker},
            start_new_session=True,
        )
        try:
            proc.stdin.write(code.encode("utf-8", "surrogateescape"))
        except BrokenPipeError:  # init died early; its stderr says why
            pass
        finally:
            proc.stdin.close()
        return proc

    def _launch_process(self, code, call_dir, uid, marker, procs_paths):
        workdir = os.path.join(call_dir, "work")
        os.mkdir(workdir, 0o700)
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(code)
        drop_to = uid if self._is_root else None
        if drop_to is not None:
            os.chmod(call_dir, 0o711)
            for path in (workdir, os.path.join(workdir, "main.py")):
                os.chown(path, uid, uid)
        nproc = self.limits.max_processes + (0 if drop_to is not None else _count_own_processes())
        config = {
            "mode": "process",
            "uid": drop_to,
            "nproc": nproc,
            "workdir": workdir,
            "argv": [self.python, "-I", "-u", "-c", _SOCKET_BLOCK_PREAMBLE],
            "env": self._env(marker),
            "limits": asdict(self.limits),
            "cgroup_procs": procs_paths,
        }
        return subprocess.Popen(
            self._launcher(config),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=self._env(marker),
            start_new_session=True,
        )

    @staticmethod
    def _launcher(config: dict) -> list[str]:
        """The trusted set-up process (``_sandbox_init.py``), run by this interpreter in isolated mode."""
        return [sys.executable, "-I", "-S", _INIT_SCRIPT, json.dumps(config)]

    def _exit_code(self, returncode: int | None, killed_by_us: bool) -> int | None:
        if returncode is None:
            return None
        if self.isolation == "namespaces" and 128 < returncode < 128 + 65 and not killed_by_us:
            return -(returncode - 128)  # PID 1 inside the namespace reports signals as 128 + N
        return returncode


def _resolve_isolation(requested: str) -> str:
    if requested not in ("auto", "namespaces", "process"):
        raise ValueError(f"isolation must be 'auto', 'namespaces' or 'process', got {requested!r}.")
    if requested == "auto":
        return iso.detect_isolation()
    if requested == "namespaces" and not iso.namespaces_available():
        raise ValueError(
            "isolation='namespaces' needs root and util-linux unshare on this host; "
            "use isolation='auto' or 'process'."
        )
    return requested


def _check_reachable_by_others(python: str) -> None:
    """Process isolation as root runs the code under a per-call uid: it must be able to start ``python``."""
    blocked = [d for d in iso.interpreter_dirs(python) if iso.first_closed_ancestor(d) is not None]
    if blocked:
        raise ValueError(
            f"python_executable={python!r} lives under {iso.first_closed_ancestor(blocked[0])!r}, which the "
            "sandbox's unprivileged uid cannot enter; pass a world-readable interpreter (/usr/bin/python3) "
            "or use isolation='namespaces'."
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


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the call's process group (in namespace mode this also tears the PID namespace down)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
