"""The fallback isolation level (no namespaces): process group, rlimits, uid drop, marker-based cleanup."""

import os
import shutil
import socket
import sys
import time

import pytest

from tests.tools.helpers import TIGHT, descendants, own_call_dirs
from trl_gptoss.tools import PythonSandbox, SandboxLimits
from trl_gptoss.tools.sandbox.process import MARKER_VAR

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox uses Linux rlimits and /proc")


@pytest.fixture(scope="module")
def fallback():
    # As root the call drops to a per-call uid, which cannot traverse a private interpreter install
    # (e.g. under /root): use the system interpreter, which any uid can start.
    python = shutil.which("python3", path="/usr/bin:/bin") if os.geteuid() == 0 else sys.executable
    if python is None:
        pytest.skip("no system python3 for an unprivileged uid")
    return PythonSandbox(SandboxLimits(**{**TIGHT, "wall_seconds": 2.0}), isolation="process", python_executable=python)


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    before = set(descendants(os.getpid()))
    yield
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and descendants(os.getpid(), ignore=before):
        time.sleep(0.05)
    assert descendants(os.getpid(), ignore=before) == [] and own_call_dirs() == []


def test_output_exit_code_and_environment(fallback, monkeypatch):
    monkeypatch.setenv("TRL_GPTOSS_TEST_SECRET", "hunter2-token")
    result = fallback.run("import os\nprint(sorted(os.environ))\nraise SystemExit(4)")
    assert result.isolation == "process" and result.exit_code == 4
    assert "TRL_GPTOSS_TEST_SECRET" not in result.stdout and MARKER_VAR in result.stdout


def test_timeout_and_output_cap(fallback):
    assert fallback.run("while True: pass").timed_out
    flood = fallback.run("print('y' * (50 << 20))")
    assert flood.truncated and len(flood.stdout) <= TIGHT["output_bytes"]


def test_daemon_escaping_the_process_group_is_found_by_its_marker(fallback):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    print('daemon', os.getpid(), flush=True)\n"
        "    time.sleep(60)\n"
        "time.sleep(0.2)\n"
        "print('left a daemon')\n"
    )
    result = fallback.run(code)
    assert result.ok and result.wall_time < 3.0
    daemon_pid = int(result.stdout.split()[1])
    deadline = time.monotonic() + 2.0  # SIGKILL is delivered asynchronously
    while _alive(daemon_pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(daemon_pid), "the setsid daemon outlived the call"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_python_level_socket_block(fallback):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}))"
        result = fallback.run(code)
    assert "network access is disabled" in result.stderr


def test_fork_bomb_is_contained_without_namespaces(fallback):
    result = fallback.run("import os\nwhile True:\n    os.fork()\n")
    assert not result.ok
    assert "BlockingIOError" in result.stderr or result.timed_out


def test_interpreter_the_sandbox_uid_cannot_reach_is_refused():
    if os.geteuid() != 0 or not os.path.realpath(sys.executable).startswith("/root/"):
        pytest.skip("needs an interpreter the per-call uid cannot reach (root + a pyenv under /root)")
    with pytest.raises(ValueError, match="world-readable interpreter"):
        PythonSandbox(isolation="process")
