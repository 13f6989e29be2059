"""The vLLM server's watchdog, on real processes: a parent starts a stand-in server (a process group of its
own, as ``VLLMServer.start`` makes it) and the watchdog exactly as ``VLLMServer`` does; then the parent is
SIGKILLed (the group dies, the files go) or stops cleanly (the watchdog leaves without touching anything)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from trl_gptoss.rollout.server import live_group_members

# The parent: a "server" (sleep, with a child of its own, like the API server and its engine core) in a new
# session, then VLLMServer's own watchdog start-up; prints the server's pgid, then waits to be killed or stops.
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from trl_gptoss.rollout.server import VLLMServer
    server = VLLMServer.__new__(VLLMServer)
    server.process = subprocess.Popen(["sh", "-c", "sleep 1000 & sleep 1000"], start_new_session=True)
    server.log_path = Path(sys.argv[1])
    server.remove_on_exit = [Path(sys.argv[2])]
    server._watchdog_pipe = server._start_watchdog()
    print(server.process.pid, flush=True)
    if sys.argv[3] == "stop":
        server._disarm_watchdog()
        print("disarmed", flush=True)
    time.sleep(1000)
""")


def _watchdogs(pgid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(part.endswith("server_watchdog.py") for part in cmdline) and str(pgid) in cmdline:
            found.append(proc)
    return found


def _start(tmp_path, mode):
    log, model_copy = tmp_path / "server.log", tmp_path / "model-copy"
    log.write_text("log")
    model_copy.mkdir()
    (model_copy / "model.safetensors").write_bytes(b"x")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(log), str(model_copy), mode], stdout=subprocess.PIPE, text=True
    )
    pgid = int(parent.stdout.readline())
    return parent, pgid, log, model_copy


def _until(condition, timeout):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


def test_sigkill_of_the_parent_kills_the_server_group_and_removes_its_files(tmp_path):
    parent, pgid, log, model_copy = _start(tmp_path, "kill")
    try:
        assert _until(lambda: len(live_group_members(pgid)) >= 2, 10)  # sh forks its background child first
        assert _until(lambda: _watchdogs(pgid), 10)
        assert parent.pid not in {p.ppid() for p in _watchdogs(pgid)}, "the watchdog must be detached"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _until(lambda: not live_group_members(pgid), 15), f"still alive: {live_group_members(pgid)}"
        assert _until(lambda: not log.exists() and not model_copy.exists(), 5)
        assert _until(lambda: not _watchdogs(pgid), 5)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()  # else its GC warns (ResourceWarning) inside whichever test runs then
        for pid in live_group_members(pgid):
            os.kill(pid, signal.SIGKILL)


def test_a_disarmed_watchdog_leaves_and_touches_nothing(tmp_path):
    parent, pgid, log, model_copy = _start(tmp_path, "stop")
    try:
        assert parent.stdout.readline().strip() == "disarmed"
        assert _until(lambda: not _watchdogs(pgid), 10), "the watchdog did not leave on stop"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        time.sleep(1.0)
        assert len(live_group_members(pgid)) >= 2 and log.exists() and model_copy.exists()
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()  # else its GC warns (ResourceWarning) inside whichever test runs then
        for pid in live_group_members(pgid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("thread", [False, True], ids=["main-thread", "other-thread"])
def test_pdeathsig_only_from_the_main_thread(thread):
    from trl_gptoss.rollout.server import _die_with_parent

    if not thread:
        assert callable(_die_with_parent())
        return
    import threading

    result = []
    worker = threading.Thread(target=lambda: result.append(_die_with_parent()))
    worker.start()
    worker.join()
    assert result == [None]
