"""The zygote: each call a fresh fork in its own namespaces, nothing carried between calls, and a zygote that
survives its calls, comes back when killed and ends with its host.

Real zygotes and real calls under the test limits; the hostile corpus runs against both launchers through
the ``LAUNCHERS`` parametrization of its fixtures, these cases are the zygote's own.
"""

import ast
import os
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.tools.helpers import (
    TIGHT,
    assert_no_call_process_left,
    descendants,
    is_zygote,
    sandbox_for,
)
from trl_gptoss.tools import PythonSandbox, SandboxLimits, detect_isolation
from trl_gptoss.tools.sandbox import preforked

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or detect_isolation() != "namespaces", reason="the zygote needs namespace isolation"
)


@pytest.fixture(scope="module")
def sandbox():
    sandbox = sandbox_for(True, SandboxLimits(**TIGHT), max_concurrency=4)
    yield sandbox
    sandbox.close()


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    before = set(descendants(os.getpid()))
    yield
    assert_no_call_process_left(before)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def _zygote_pid(sandbox) -> int:
    """Host pid of the zygote's Python process (the outer bubblewrap's grandchild)."""
    pid = sandbox._zygote.pid
    for _ in range(2):
        pid = _children(pid)[0]
    assert is_zygote(pid)
    return pid


def test_between_calls_the_zygote_holds_one_spare_call_and_nothing_else(sandbox):
    """The zygote's children are calls' PID 1s; once every call has ended only the spare is left: its PID 1
    and its program, waiting as uid 0 (no request, no code) in a PID namespace of their own."""
    sandbox.run_many(["import os\nif os.fork() == 0:\n    os.setsid()\nprint(1)"] * 6)
    zygote = _zygote_pid(sandbox)
    deadline = time.monotonic() + 10.0  # the spare is made after the last call ends: its PID 1, then its program

    def spare_is_ready() -> bool:
        children = _children(zygote)
        return len(children) == 1 and len(_children(children[0])) == 1

    while not spare_is_ready() and time.monotonic() < deadline:
        time.sleep(0.02)
    (pid1,) = _children(zygote)
    (program,) = _children(pid1)
    assert _children(program) == [] and is_zygote(pid1) and is_zygote(program)
    with open(f"/proc/{program}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    assert status["NSpid"].split()[-1] == "2" and status["Uid"].split()[0] == "0"


IDENTITY = (
    "import os\n"
    "print(os.getpid(), os.readlink('/proc/self/ns/pid'), os.readlink('/proc/self/ns/mnt'),"
    " os.readlink('/proc/self/ns/net'), os.readlink('/proc/self/ns/ipc'), os.getuid())\n"
)


def test_each_call_is_a_new_process_in_new_namespaces_of_the_same_zygote(sandbox):
    first = sandbox.run(IDENTITY)
    zygote = _zygote_pid(sandbox)
    second = sandbox.run(IDENTITY)
    assert first.ok and second.ok, (first, second)
    a, b = first.stdout.split(), second.stdout.split()
    assert a[0] == b[0] == "2", "the program is PID 2 of its own namespace (PID 1 reaps)"
    for kind, x, y in zip(("pid", "mnt", "net", "ipc"), a[1:5], b[1:5]):
        assert x != y, f"two calls shared a {kind} namespace"
    assert int(a[5]) >= 1000 and int(b[5]) >= 1000
    assert _zygote_pid(sandbox) == zygote and sandbox._zygote.starts == 1


def test_the_call_is_confined_like_a_bubblewrap_call(sandbox):
    code = (
        "import resource\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print({k: status[k].strip() for k in ('CapEff', 'CapPrm', 'NoNewPrivs', 'Seccomp')})\n"
        "names = ('CPU', 'AS', 'NPROC', 'FSIZE', 'NOFILE', 'CORE')\n"
        "print({n: resource.getrlimit(getattr(resource, 'RLIMIT_' + n)) for n in names})\n"
        "print(open('/proc/self/cgroup').read().count('trl-gptoss-sandbox-'))\n"
    )
    result = sandbox.run(code)
    assert result.ok, result.render()
    status, limits, groups = result.stdout.splitlines()
    assert ast.literal_eval(status) == {"CapEff": "0" * 16, "CapPrm": "0" * 16, "NoNewPrivs": "1", "Seccomp": "2"}
    lim = sandbox.limits
    assert ast.literal_eval(limits) == {
        "CPU": (lim.cpu_seconds,) * 2,
        "AS": (lim.address_space_bytes,) * 2,
        "NPROC": (lim.max_processes,) * 2,
        "FSIZE": (lim.file_size_bytes,) * 2,
        "NOFILE": (lim.open_files,) * 2,
        "CORE": (0, 0),
    }
    assert int(groups) == (0 if sandbox.cgroups is None else 3 if sandbox.cpu_quota else 2)


LEAVE_STATE = (
    "import builtins, json, os, signal, subprocess, sys, threading, time\n"
    "open('/tmp/left.txt', 'w').write('x'); open('/mnt/data/left.txt', 'w').write('x')\n"
    "json.LEFT = 1; builtins.LEFT = 2; builtins.print = None\n"
    "os.environ['LEFT'] = '1'; os.chdir('/mnt/data')\n"
    "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    time.sleep(60)\n"
    "sys.modules['left_module'] = json\n"
    "sys.stdout.write('left\\n')\n"
)
FIND_STATE = (
    "import builtins, json, os, signal, sys, threading\n"
    "print((os.path.exists('/tmp/left.txt'), os.path.exists('/mnt/data/left.txt'), hasattr(json, 'LEFT'),"
    " hasattr(builtins, 'LEFT'), 'LEFT' in os.environ, os.getcwd(),"
    " signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL, threading.active_count(),"
    " sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), 'left_module' in sys.modules))\n"
)


def test_nothing_a_call_leaves_reaches_the_next(sandbox):
    left = sandbox.run(LEAVE_STATE)
    assert left.ok and left.stdout == "left\n", left.render()
    found = sandbox.run(FIND_STATE)
    assert found.ok, found.render()
    assert ast.literal_eval(found.stdout) == (False, False, False, False, False, "/tmp/work", True, 1, [1, 2], False)


def test_random_state_differs_between_calls(sandbox):
    code = "import random, numpy\nprint(random.random(), numpy.random.rand())\n"
    first, second = sandbox.run(code), sandbox.run(code)
    assert first.ok and second.ok, first.render()
    a, b = first.stdout.split(), second.stdout.split()
    assert a[0] != b[0] and a[1] != b[1], "two calls drew the same random numbers"


def test_numpy_is_preloaded(sandbox):
    result = sandbox.run("import sys\nprint('numpy' in sys.modules)\n")
    assert result.ok and result.stdout == "True\n", result.render()


def test_concurrent_calls_cannot_see_signal_or_reach_each_other(sandbox):
    """Two calls at once: each sees only its own PID 1 and 2, its kill(-1) touches nothing of the other, its
    loopback and /tmp are its own."""
    listener = (
        "import os, socket, time\n"
        "server = socket.socket()\n"
        "server.bind(('127.0.0.1', 47111))\n"
        "server.listen(1)\n"
        "open('/tmp/mine', 'w').write('a')\n"
        "time.sleep(1.5)\n"
        "print('alive', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
    )
    attacker = (
        "import os, signal, socket, time\n"
        "time.sleep(0.5)\n"
        "try:\n"
        "    os.kill(-1, signal.SIGKILL)\n"
        "except ProcessLookupError:\n"
        "    pass  # nothing it may signal but itself\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 47111), timeout=0.5)\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print('refused', type(exc).__name__)\n"
        "print(os.path.exists('/tmp/mine'), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
    )
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(sandbox.run, [listener, attacker])
    assert first.ok and first.stdout == "alive [1, 2]\n", first.render()
    assert second.ok and second.stdout == "refused ConnectionRefusedError\nFalse [1, 2]\n", second.render()


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.abort()\n",
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
        "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"
        "os.kill(1, signal.SIGKILL)\n",
        "import os\nwhile True:\n    os.fork()\n",
        "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\n",
        "import ctypes\nctypes.string_at(0)\n",
        "import os\nos.closerange(0, 1 << 16)\nraise SystemExit(5)\n",
    ],
    ids=["abort", "kill-self", "kill-all", "fork-bomb", "memory", "segfault", "close-all-fds"],
)
def test_the_zygote_survives_a_call_that_crashes(sandbox, code):
    sandbox.run("print(1)")
    zygote = _zygote_pid(sandbox)
    crashed = sandbox.run(code)
    assert not crashed.ok
    after = sandbox.run("print(1)")
    assert after.ok and after.stdout == "1\n", after.render()
    assert _zygote_pid(sandbox) == zygote, "the zygote was replaced"


def test_a_dead_zygote_is_replaced_transparently():
    sandbox = sandbox_for(True, SandboxLimits(**TIGHT))
    try:
        assert sandbox.run("print(1)").ok
        os.kill(_zygote_pid(sandbox), signal.SIGKILL)
        time.sleep(0.2)
        result = sandbox.run("print(2)")
        assert result.ok and result.stdout == "2\n", result.render()
        assert sandbox._zygote.starts == 2
    finally:
        sandbox.close()


def test_a_call_running_when_its_zygote_dies_ends_with_it():
    sandbox = sandbox_for(True, SandboxLimits(**{**TIGHT, "wall_seconds": 10.0}))
    try:
        sandbox.run("print(1)")
        zygote = _zygote_pid(sandbox)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(sandbox.run, "import time\ntime.sleep(8)\nprint('finished')")
            time.sleep(0.5)
            os.kill(zygote, signal.SIGKILL)
            result = pending.result(timeout=5)
        assert not result.ok and result.stdout == "" and result.wall_time < 5
        assert sandbox.run("print(3)").stdout == "3\n"
    finally:
        sandbox.close()


def test_close_ends_the_zygote_and_a_later_call_starts_another():
    sandbox = sandbox_for(True, SandboxLimits(**TIGHT))
    sandbox.run("print(1)")
    zygote = sandbox._zygote.pid
    sandbox.close()
    assert not os.path.exists(f"/proc/{zygote}"), "close() left the zygote's bubblewrap running"
    assert sandbox.run("print(1)").ok and sandbox._zygote.starts == 2
    sandbox.close()


def test_a_zygote_is_refused_where_it_cannot_run_and_auto_falls_back(tmp_path, monkeypatch):
    system = shutil.which("python3", path="/usr/bin:/bin") if os.geteuid() == 0 else sys.executable
    with pytest.raises(ValueError, match="zygote=True"):
        PythonSandbox(isolation="process", python_executable=system, zygote=True)
    assert not PythonSandbox(isolation="process", python_executable=system).zygote
    assert not PythonSandbox(zygote=False).zygote
    monkeypatch.setattr(preforked, "zygote_problem", lambda view: "no zygote on this host")
    fallback = PythonSandbox(SandboxLimits(**TIGHT))
    assert not fallback.zygote and fallback.run("print(1)").stdout == "1\n"


def test_a_zygote_that_cannot_start_falls_back_to_a_bubblewrap_per_call(monkeypatch):
    sandbox = sandbox_for(None, SandboxLimits(**TIGHT))
    if not sandbox.zygote:
        pytest.skip("no zygote on this host")

    def broken(self, control_fd):
        os.close(control_fd)
        raise preforked.ZygoteError("the sandbox's zygote did not start: broken on purpose")

    monkeypatch.setattr(preforked.Zygote, "_launch", broken)
    with pytest.warns(UserWarning, match="broken on purpose"):
        result = sandbox.run("print(1)")
    assert result.ok and result.stdout == "1\n" and not sandbox.zygote


def test_nothing_the_calls_share_is_writable(sandbox):
    """The zygote's own file system (the root, /dev, /.sandbox, /mnt) is shared by its calls: none of it may
    take a write, or a call could leave a file for the next one."""
    code = (
        "import os\n"
        "for path in ['/x', '/dev/x', '/.sandbox/x', '/mnt/x', '/.sandbox/zygote.py', '/proc/sys/kernel/x']:\n"
        "    try:\n"
        "        open(path, 'a').close()\n"
        "        print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print('refused', path, type(exc).__name__)\n"
    )
    result = sandbox.run(code)
    assert result.ok and "wrote" not in result.stdout and result.stdout.count("refused") == 6, result.render()


def test_an_interpreter_under_tmp_is_served_by_the_zygote(sandbox):
    """A virtualenv under ``/tmp`` (a clone there): every call mounts its own ``/tmp``, with the interpreter's
    paths rebuilt on it -- read-only, in root's directories the call can neither rename nor remove -- and
    nothing else of the previous call's ``/tmp``."""
    home = tempfile.mkdtemp(dir="/tmp", prefix="venv-under-tmp-")
    link = os.path.join(home, "env")
    os.symlink(sys.prefix, link)
    python = os.path.join(link, os.path.relpath(sys.executable, sys.prefix))
    code = (
        "import os, sys, numpy\n"
        "print(sys.executable, os.path.exists('/tmp/left'))\n"
        "open('/tmp/left', 'w').close()\n"
        f"rows = [line.split() for line in open('/proc/self/mountinfo') if line.split()[4].startswith({home!r})]\n"
        "print(len(rows) > 0, sorted({row[5].split(',')[0] for row in rows}))\n"
        "for attempt in (lambda: os.rename(os.path.dirname(os.path.dirname(sys.executable)), '/tmp/moved'),\n"
        "                lambda: open(os.path.join(sys.prefix, 'pyvenv.cfg'), 'a'), lambda: os.rmdir(sys.prefix)):\n"
        "    try:\n"
        "        attempt()\n"
        "        print('changed')\n"
        "    except OSError:\n"
        "        print('refused')\n"
    )
    try:
        under_tmp = PythonSandbox(SandboxLimits(**TIGHT), python_executable=python, zygote=True)
        results = [under_tmp.run(code) for _ in range(2)]
        under_tmp.close()
    finally:
        shutil.rmtree(home)
    expected = f"{python} False\nTrue ['ro']\n" + "refused\n" * 3
    for result in results:
        assert result.ok and result.stdout == expected, result.render()
