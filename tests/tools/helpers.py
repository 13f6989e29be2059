"""Host-side probes used by the sandbox tests: leftover processes and temporary directories."""

import glob
import os
import tempfile
import time

import pytest

from trl_gptoss.tools.sandbox import cgroups, userns
from trl_gptoss.tools.sandbox.runner import CALL_DIR_PREFIX

TIGHT = dict(
    wall_seconds=5.0,
    cpu_seconds=5,
    address_space_bytes=512 << 20,
    max_processes=32,
    file_size_bytes=1 << 20,
    disk_bytes=8 << 20,
    output_bytes=64 * 1024,
    memory_bytes=512 << 20,
)


# The two ways a namespaced call starts: its own bubblewrap, or a fork of the sandbox's zygote.
LAUNCHERS = [pytest.param(False, id="bwrap"), pytest.param(True, id="zygote")]


def sandbox_for(zygote: bool, *args, **kwargs):
    """A ``PythonSandbox(..., zygote=zygote)``; skips the test where this host cannot run a zygote."""
    from trl_gptoss.tools import PythonSandbox

    try:
        return PythonSandbox(*args, zygote=zygote, **kwargs)
    except ValueError as exc:
        if zygote and "zygote" in str(exc):
            pytest.skip(str(exc))
        raise


def sandbox_uid_range(pid: int | None = None) -> range:
    """The uids process ``pid`` (default: this one) hands to its sandbox calls (``userns.UidSlots``)."""
    pid = os.getpid() if pid is None else pid
    first = userns.UID_BASE + (pid % (1 << 20)) * userns.SLOTS_PER_PROCESS
    return range(first, first + userns.SLOTS_PER_PROCESS)


def processes_of_uids(uids: range) -> list[int]:
    """Live (non-zombie) host pids whose real uid is in ``uids``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        real_uid = int(status["Uid"].split()[0])
        if real_uid in uids and not status["State"].strip().startswith("Z"):
            found.append(int(entry))
    return found


def own_call_dirs() -> list[str]:
    """Call directories this test process created and did not remove."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"{CALL_DIR_PREFIX}{os.getpid()}-*"))


def own_cgroups(token: str | None = None) -> list[str]:
    """Per-call cgroups that a process (default: this one; else the one whose ``PROCESS_TOKEN`` is ``token``)
    created and did not remove."""
    pattern = f"{cgroups.GROUP_PREFIX}{token or cgroups.PROCESS_TOKEN}-*"
    return glob.glob(os.path.join(cgroups.ROOT, "*", pattern)) + glob.glob(os.path.join(cgroups.ROOT, pattern))


def is_zygote(pid: int) -> bool:
    """A process of a sandbox's zygote that runs no model code: the zygote, its two bubblewrap processes, the
    spare call it keeps ready (PID 1 and the waiting program) and a call's PID 1 (the trusted reaper). All
    run its code as uid 0; a call's program drops to an unprivileged uid before any model code runs."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"/.sandbox/zygote.py" not in f.read():
                return False
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    return status["Uid"].split()[0] == "0"


def descendants(pid: int, ignore=()) -> list[int]:
    """All live descendants of ``pid`` found through /proc (ppid links), except the subtrees rooted at
    ``ignore`` (processes that were there before the call, e.g. a session-wide vLLM server fixture) and
    sandbox zygotes' own processes (``is_zygote``; the calls' programs and what they start are listed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in ignore:
                if not is_zygote(child):
                    out.append(child)
                todo.append(child)
    return out


def assert_no_call_process_left(before: set[int], grace: float = 2.0) -> None:
    """No process of the sandbox uids and no descendant of this process beyond ``before`` (its descendants when
    the case began), once the kernel has had ``grace`` seconds to tear the calls' PID namespaces down."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (
        processes_of_uids(sandbox_uid_range()) or descendants(os.getpid(), ignore=before)
    ):
        time.sleep(0.05)
    assert processes_of_uids(sandbox_uid_range()) == [], "a sandboxed process outlived its call"
    left = descendants(os.getpid(), ignore=before)
    assert left == [], f"a child of the test process outlived the call: {[_describe(pid) for pid in left]}"


def _describe(pid: int) -> str:
    """``pid``, its parent, uid, state and command line, as /proc shows them (for a failure message)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return f"{pid} (gone)"
    fields = {k: status.get(k, "").split()[0] if status.get(k, "").split() else "" for k in ("PPid", "Uid", "State")}
    return f"{pid} ppid={fields['PPid']} uid={fields['Uid']} state={fields['State']} {command!r}"
