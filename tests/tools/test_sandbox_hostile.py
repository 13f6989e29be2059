"""Hostile-code corpus: each case is contained, the host is unaffected, nothing is left behind.

Limits are tight (32 processes, 512 MiB address space, 5 s wall) so a failure cannot hurt the shared
machine. Every case runs under the strongest isolation the host offers; the fallback level has its own
cases in ``test_sandbox_fallback.py``.
"""

import ast
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.tools.helpers import (
    LAUNCHERS,
    TIGHT,
    assert_no_call_process_left,
    descendants,
    own_call_dirs,
    own_cgroups,
    processes_of_uids,
    sandbox_for,
    sandbox_uid_range,
)
from trl_gptoss.tools import PythonSandbox, SandboxLimits, detect_isolation

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the sandbox uses Linux rlimits and /proc"),
    pytest.mark.skipif(detect_isolation() != "namespaces", reason="needs root + unshare (namespace isolation)"),
]


@pytest.fixture(scope="module", params=LAUNCHERS)
def zygote(request):
    return request.param


@pytest.fixture(scope="module")
def sandbox(zygote):
    sandbox = sandbox_for(zygote, SandboxLimits(**TIGHT))
    yield sandbox
    sandbox.close()


@pytest.fixture(scope="module")
def short_clock(zygote):
    """Cases that only end at the wall clock use 1.5 s to keep the suite fast."""
    sandbox = sandbox_for(zygote, SandboxLimits(**{**TIGHT, "wall_seconds": 1.5}))
    yield sandbox
    sandbox.close()


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    """After every case: no process of the sandbox uids, no new descendant of this process, no call dir."""
    before = set(descendants(os.getpid()))
    yield
    assert_no_call_process_left(before)  # the kernel tears a PID namespace down asynchronously
    assert own_call_dirs() == [], "a call's temporary directory was not removed"
    assert own_cgroups() == [], "a call's cgroup was not removed"


def test_infinite_loop_is_killed_at_the_wall_clock(short_clock):
    result = short_clock.run("while True:\n    pass\n")
    assert result.timed_out and not result.ok
    assert 1.5 <= result.wall_time < 1.5 + 2.0
    assert "timed out" in result.render()


def test_fork_bomb_is_capped_by_the_process_limit(sandbox):
    code = "import os\nwhile True:\n    os.fork()\n"
    result = sandbox.run(code)
    assert not result.ok
    assert "BlockingIOError" in result.stderr or result.timed_out
    # The host can still start processes.
    assert subprocess.run(["true"]).returncode == 0


def test_memory_bomb_hits_the_address_space_limit(sandbox):
    result = sandbox.run("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\n")
    assert result.exit_code != 0 and not result.timed_out
    assert "MemoryError" in result.stderr


def test_many_processes_together_over_the_memory_budget_are_oom_killed(sandbox):
    """Each child stays under RLIMIT_AS (512 MiB) but 8 x 128 MiB exceed the call's 512 MiB cgroup."""
    if sandbox.cgroups is None:
        pytest.skip("the host gives us no memory cgroup; only per-process RLIMIT_AS applies")
    code = (
        "import os, time\n"
        "kids = []\n"
        "for _ in range(8):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = bytearray(128 << 20)\n"
        "        time.sleep(0.5)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "print(sorted(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids))\n"
    )
    # Reclaim at the cgroup limit is slow on a loaded 2-core host: more wall clock and CPU quota for this case.
    roomy = PythonSandbox(SandboxLimits(**{**TIGHT, "wall_seconds": 15.0, "cpu_cores": 2.0}), zygote=sandbox.zygote)
    result = roomy.run(code)
    roomy.close()
    assert result.ok, result
    statuses = ast.literal_eval(result.stdout)
    assert -9 in statuses, "no child was OOM-killed although the group went over its budget"
    assert statuses.count(0) <= 4


def test_writes_outside_the_working_dir_never_reach_the_host(sandbox, tmp_path):
    target = tmp_path / "escape.txt"
    os.chmod(tmp_path, 0o777)  # even a world-writable host directory must stay untouched
    code = (
        "import os\n"
        f"for path in [{str(target)!r}, '/work/escape.txt', '/etc/escape.txt', '/root/escape.txt']:\n"
        "    try:\n"
        "        open(path, 'w').write('pwned')\n"
        "        print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print('blocked', path, type(exc).__name__)\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print('inside ok', os.path.getsize('inside.txt'), os.getcwd())\n"
    )
    result = sandbox.run(code)
    assert result.ok, result.stderr
    assert "inside ok 4" in result.stdout
    assert not target.exists()
    assert not os.path.exists("/work/escape.txt") and not os.path.exists("/etc/escape.txt")
    assert "wrote" not in result.stdout and result.stdout.count("blocked") == 4


def test_secret_environment_of_the_parent_is_not_visible(sandbox, monkeypatch):
    monkeypatch.setenv("TRL_GPTOSS_TEST_SECRET", "hunter2-token")
    code = (
        "import os\n"
        "print(sorted(os.environ))\n"
        f"for pid in ['1', {str(os.getpid())!r}, 'self']:\n"
        "    try:\n"
        "        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print(pid, 'unreadable', type(exc).__name__)\n"
    )
    result = sandbox.run(code)
    assert result.exit_code == 0, result.stderr
    assert "hunter2-token" not in result.stdout + result.stderr
    assert "TRL_GPTOSS_TEST_SECRET" not in result.stdout


def test_network_connection_to_a_host_listener_fails(sandbox):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=1).close()\n"
            "        print('connected', addr)\n"
            "    except OSError as exc:\n"
            "        print('refused', addr, type(exc).__name__)\n"
        )
        result = sandbox.run(code)
        with pytest.raises(TimeoutError):
            server.accept()
    assert result.exit_code == 0, result.stderr
    assert "connected" not in result.stdout and result.stdout.count("refused") == 2


def test_hundred_megabytes_of_output_is_truncated_without_buffering_it(sandbox):
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    result = sandbox.run(code)
    assert result.truncated and not result.ok
    assert len(result.stdout) + len(result.stderr) <= TIGHT["output_bytes"]
    assert result.wall_time < TIGHT["wall_seconds"]
    assert len(result.render(max_chars=500)) <= 500


def test_daemon_that_outlives_the_call_is_killed(sandbox):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('parent leaves')\n"
    )
    result = sandbox.run(code)
    assert result.ok and "parent leaves" in result.stdout
    assert result.wall_time < 3.0, "a daemon holding the output pipes must not stall the call"
    # _nothing_left_behind then asserts the grandchild is gone.


def test_killing_the_parent_and_everyone_else_fails(sandbox):
    sentinel = subprocess.Popen(["sleep", "30"])
    try:
        code = (
            "import os, signal\n"
            f"for pid in [os.getppid(), 1, {os.getpid()}, {sentinel.pid}, -1]:\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "        print('sent', pid)\n"
            "    except OSError as exc:\n"
            "        print('denied', pid, type(exc).__name__)\n"
            "print('still here')\n"
        )
        result = sandbox.run(code)
        assert sentinel.poll() is None, "the sandbox killed a host process"
    finally:
        sentinel.kill()
        sentinel.wait()
    assert f"sent {sentinel.pid}" not in result.stdout and f"sent {os.getpid()}" not in result.stdout


def test_deep_recursion_is_contained(short_clock):
    code = "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1)\nf(0)\n"
    result = short_clock.run(code)
    assert result.exit_code != 0
    assert not result.ok


def test_large_file_is_capped_by_the_file_size_limit(sandbox):
    code = "with open('big.bin', 'wb') as f:\n    f.write(b'0' * (4 << 20))\n"
    result = sandbox.run(code)
    assert not result.ok  # SIGXFSZ or EFBIG at 1 MiB


def test_call_ends_when_the_host_process_is_killed_mid_call(zygote):
    """A host (a trainer) SIGKILLed in the middle of a call cannot clean up: bubblewrap's --die-with-parent
    must end every process of the call anyway. (Its empty cgroups stay behind; this test removes them.)"""
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from trl_gptoss.tools import PythonSandbox\n"
            "from trl_gptoss.tools.sandbox import cgroups\n"
            "print(cgroups.PROCESS_TOKEN, flush=True)\n"
            f"PythonSandbox(zygote={zygote}).run('import os, time\\nos.fork()\\ntime.sleep(100)')",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        token = host.stdout.readline().strip()
        uids = sandbox_uid_range(host.pid)
        assert _wait_until(lambda: len(processes_of_uids(uids)) >= 2, 30.0), "the call did not start"
        host.kill()
        host.wait()
        assert _wait_until(lambda: not processes_of_uids(uids), 2.0), "the call outlived its host"
    finally:
        host.kill()
        host.wait()
        host.stdout.close()
        for group in own_cgroups(token):
            os.rmdir(group)


def _wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_filling_the_disk_stops_at_the_private_tmpfs_size(sandbox):
    code = (
        "import errno\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(64):\n"
        "        with open(f'fill{i}.bin', 'wb') as f:\n"
        "            f.write(b'0' * (900 << 10))\n"
        "        written += 900 << 10\n"
        "except OSError as exc:\n"
        "    print('stopped', errno.errorcode[exc.errno], written)\n"
    )
    result = sandbox.run(code)
    assert result.ok, result.stderr
    reason, written = result.stdout.split()[1:]
    assert reason == "ENOSPC" and int(written) <= TIGHT["disk_bytes"]
