"""The host's side of the sandbox under attack or failure: planted staging names, and a host killed mid-launch.

Real mounts and real kills: the staging reaper is run against a symlink and another user's directory planted
in ``$TMPDIR`` (each hiding a real tmpfs mount), and hosts are SIGKILLed at chosen moments of a call's launch
under a subreaper that then lists what is still alive.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from trl_gptoss.tools import detect_isolation
from trl_gptoss.tools.sandbox import scratch


def _mounted(path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def _dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1  # above pid_max: no process has it, ever


def test_reaping_stale_staging_never_follows_a_planted_link_nor_touches_others_directories(tmp_path, monkeypatch):
    if os.geteuid() != 0 or not scratch.host_can_mount():
        pytest.skip("needs a host that mounts the scratch tmpfs itself (root with CAP_SYS_ADMIN)")
    shared = tmp_path / "tmp"
    shared.mkdir(mode=0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    prefix = f"{scratch.STAGING_PREFIX}{_dead_pid()}-"
    victim, foreign, own = tmp_path / "victim", shared / f"{prefix}foreign", shared / f"{prefix}own"
    mounts = [victim / "0", foreign / "0", own / "0"]
    for path in mounts:
        path.mkdir(parents=True)
        scratch._mount("tmpfs", str(path), "tmpfs", 0, "size=64k")
    (shared / f"{prefix}link").symlink_to(victim)  # a user's link to a mount of their choice
    foreign.chmod(0o700)
    os.chown(foreign, 65534, 65534)  # another user's directory, named like a staging directory
    own.chmod(0o700)
    try:
        assert scratch.reap_dead_staging() == 1
        assert _mounted(victim / "0") and (shared / f"{prefix}link").is_symlink(), "followed the planted symlink"
        assert _mounted(foreign / "0") and foreign.is_dir(), "touched another user's directory"
        assert not own.exists() and not _mounted(own / "0"), "this user's stale staging was not reaped"
    finally:
        for path in mounts:
            scratch._unmount(str(path))


# Runs as a subreaper: starts a host that SIGKILLs itself at the given moment of a call's launch, waits for it,
# gives what it left (orphans are re-parented to this process) 3 s to end, starts a new PythonSandbox (which
# reaps what is left waiting), then lists what is still alive 2 s later, and kills it.
_GUARDIAN = r"""
import ctypes, json, os, signal, subprocess, sys, time

ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
host = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
host.wait()

def children():
    found = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            found += [int(pid) for pid in f.read().split()]
    return found

def reap():
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return

def settle(seconds):
    deadline = time.monotonic() + seconds
    while children() and time.monotonic() < deadline:
        reap()
        time.sleep(0.05)
    reap()

settle(3.0)
left_to_next_start = len(children())
from trl_gptoss.tools import PythonSandbox

PythonSandbox()  # the next start on this host reaps what a killed host left waiting
settle(2.0)
alive = {}
for pid in children():
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        alive[pid] = f.read().replace(b"\0", b" ").decode()[:200]
for pid in alive:
    os.kill(pid, signal.SIGKILL)
time.sleep(0.2)
reap()
print(json.dumps({"host": host.returncode, "alive": alive, "left_to_next_start": left_to_next_start}))
"""

_HOST = r"""
import json, os, signal, sys, threading, time
from trl_gptoss.tools import PythonSandbox, SandboxLimits
from trl_gptoss.tools.sandbox import bwrap, preforked

moment = sys.argv[1]
zygote = moment.startswith("zygote")
real = bwrap._join_then_release

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def launched(proc, info_read, block_write, cgroup_procs):
    die()  # before bubblewrap reported its namespaces: it may not have armed --die-with-parent yet

def joined(proc, info_read, block_write, cgroup_procs):
    with os.fdopen(info_read, "rb") as info:
        child = json.loads(info.read())["child-pid"]
    for path in cgroup_procs:
        for pid in (proc.pid, child):
            with open(path, "w") as f:
                f.write(str(pid))
    die()  # in the call's cgroups, never released

def zygote_launched(self, control_fd):
    real_launch(self, control_fd)
    die()  # the zygote's bubblewrap started, the zygote not yet ready

if moment == "launched":
    bwrap._join_then_release = launched
elif moment == "joined":
    bwrap._join_then_release = joined
elif moment == "zygote-starting":
    real_launch = preforked.Zygote._launch
    preforked.Zygote._launch = zygote_launched
elif moment == "zygote-idle":
    idle = PythonSandbox(zygote=True)
    assert idle.run("print(1)").ok
    die()  # between calls: the zygote waits for the next one
if moment in ("running", "zygote-running"):
    threading.Thread(target=lambda: (time.sleep(1.0), die()), daemon=True).start()  # mid-call
PythonSandbox(SandboxLimits(wall_seconds=60, cpu_seconds=60), zygote=zygote).run("import time\ntime.sleep(60)")
"""


@pytest.mark.skipif(sys.platform != "linux" or detect_isolation() != "namespaces", reason="needs bubblewrap")
@pytest.mark.parametrize(
    "moment", ["launched", "joined", "running", "zygote-starting", "zygote-idle", "zygote-running"]
)
def test_a_host_killed_during_a_call_leaves_no_process_alive(moment):
    """Before: a host killed before its release left bubblewrap and the program running for good, outside
    every cgroup (bubblewrap goes on when its --block-fd closes), or bubblewrap's PID 1 waiting for good for its
    outer process, which --die-with-parent had killed. The zygote's moments: while its bubblewrap starts,
    while it waits between calls, and while it runs a call; neither the zygote nor a call may survive."""
    out = subprocess.run([sys.executable, "-c", _GUARDIAN, _HOST, moment], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["host"] == -9, report
    assert report["alive"] == {}, f"still running 3 s after the host died ({moment}): {report['alive']}"
    scratch.reap_dead_staging()  # the killed host's scratch mounts, if it mounted any
