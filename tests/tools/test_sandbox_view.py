"""Hostile corpus, part 2: what the code can see. The answers, the host's IPC, sockets, devices and processes
must be out of reach; only the interpreter, its standard library and the allowed packages are in view."""

import ctypes
import glob
import os
import socket
import sys
import tempfile

import pytest

import trl_gptoss
from tests.tools.helpers import LAUNCHERS, TIGHT, sandbox_for
from trl_gptoss.tools import SandboxLimits, detect_isolation

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the sandbox uses Linux namespaces"),
    pytest.mark.skipif(detect_isolation() != "namespaces", reason="needs user namespaces (bubblewrap isolation)"),
]

SAMPLES = os.path.join(os.path.dirname(trl_gptoss.__file__), "data", "samples")
ALLOWED_DEV = {"null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm", "fd", "core"}
ALLOWED_DEV |= {"stdin", "stdout", "stderr"}


@pytest.fixture(scope="module", params=LAUNCHERS)
def sandbox(request):
    sandbox = sandbox_for(request.param, SandboxLimits(**TIGHT))
    yield sandbox
    sandbox.close()


def _lines(result):
    assert result.exit_code == 0, result.stderr
    return result.stdout.splitlines()


def test_the_training_data_and_its_answers_are_invisible(sandbox):
    samples = sorted(glob.glob(os.path.join(SAMPLES, "*.jsonl")))
    assert samples, "the package ships sample data with answers"
    code = (
        "import os\n"
        "found = []\n"
        "for top in sorted(set(os.listdir('/')) - {'proc'}):\n"
        "    for root, dirs, files in os.walk('/' + top):\n"
        "        found += [os.path.join(root, f) for f in files if f.endswith('.jsonl')]\n"
        "print(found)\n"
        f"for path in {samples + [os.path.dirname(trl_gptoss.__file__)]!r}:\n"
        "    print(os.path.exists(path))\n"
        f"print(sorted(os.listdir({os.getcwd()!r})) if os.path.isdir({os.getcwd()!r}) else [])\n"
    )
    lines = _lines(sandbox.run(code))
    assert lines[0] == "[]", "a .jsonl file is visible inside the sandbox"
    assert set(lines[1:-1]) == {"False"}, "the package data is visible"
    # The repository exists inside only as the path to its virtualenv's interpreter, when it holds one.
    assert set(eval(lines[-1])) <= {".venv"}, lines[-1]  # noqa: S307 - our own repr of a list of names


def test_only_the_allowed_packages_are_importable(sandbox):
    pytest.importorskip("numpy")
    code = (
        "import importlib\n"
        "for name in ['numpy', 'sympy', 'torch', 'transformers', 'trl_gptoss', 'pip']:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        print(name, 'yes')\n"
        "    except ImportError:\n"
        "        print(name, 'no')\n"
    )
    seen = dict(line.split() for line in _lines(sandbox.run(code)))
    assert seen == {
        "numpy": "yes",
        "sympy": "yes",
        "torch": "no",
        "transformers": "no",
        "trl_gptoss": "no",
        "pip": "no",
    }


def test_host_sysv_shared_memory_is_out_of_reach_and_call_segments_die_with_the_call(sandbox):
    libc = ctypes.CDLL(None, use_errno=True)
    key, size = 0x7A11_0000 + os.getpid() % 0xFFFF, 1 << 20
    shmid = libc.shmget(key, size, 0o1666)  # IPC_CREAT | 0666: world-readable and writable
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    try:
        code = (
            "import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.shmget({key}, 0, 0) >= 0)\n"
            f"print(libc.shmget({key + 1}, {size}, 0o1666) >= 0)\n"
            "print(open('/proc/sysvipc/shm').read().count(chr(10)) - 1)\n"
        )
        assert _lines(sandbox.run(code)) == ["False", "True", "1"]  # its own segment only
        with open("/proc/sysvipc/shm") as f:
            host_keys = {int(line.split()[0]) for line in f.readlines()[1:]}
        assert key + 1 not in host_keys, "a segment created in a call outlived it on the host"
        assert _lines(sandbox.run(f"import ctypes\nprint(ctypes.CDLL(None).shmget({key + 1}, 0, 0) >= 0)")) == [
            "False"
        ], "a later call read an earlier call's segment"
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID


def test_host_unix_sockets_are_unreachable(sandbox):
    # Outside /tmp, where daemons keep their sockets (/run): a private /tmp alone would not hide it.
    with tempfile.TemporaryDirectory(dir="/run" if os.access("/run", os.W_OK) else os.getcwd()) as where:
        os.chmod(where, 0o777)
        _check_unix_sockets(sandbox, os.path.join(where, "host.sock"))


def _check_unix_sockets(sandbox, path):
    abstract = f"\0trl-gptoss-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as by_path, socket.socket(socket.AF_UNIX) as by_name:
        by_path.bind(path)
        by_name.bind(abstract)
        os.chmod(path, 0o777)
        for server in (by_path, by_name):
            server.listen(1)
            server.settimeout(0.2)
        code = (
            "import socket\n"
            f"for address in [{path!r}, {abstract!r}]:\n"
            "    try:\n"
            "        socket.socket(socket.AF_UNIX).connect(address)\n"
            "        print('connected')\n"
            "    except OSError as exc:\n"
            "        print('refused', type(exc).__name__)\n"
        )
        lines = _lines(sandbox.run(code))
        for server in (by_path, by_name):
            with pytest.raises(TimeoutError):
                server.accept()
    assert lines == ["refused FileNotFoundError", "refused ConnectionRefusedError"]


def test_dev_is_minimal_and_sys_is_absent(sandbox):
    code = "import os\nprint(sorted(os.listdir('/dev')))\nprint(os.path.exists('/sys'), os.path.exists('/run'))\n"
    lines = _lines(sandbox.run(code))
    assert set(eval(lines[0])) <= ALLOWED_DEV, lines[0]  # noqa: S307 - our own repr of a list of names
    assert lines[1] == "False False"


def test_proc_shows_no_host_pid_json_or_cgroup_names(sandbox):
    code = (
        "import os\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(open('/proc/1/cmdline', 'rb').read().decode(errors='replace'))\n"
        "print(open('/proc/self/cgroup').read())\n"
    )
    result = sandbox.run(code)
    lines = _lines(result)
    assert lines[0] == "[1, 2]", "processes outside the call are visible"
    cmdline = lines[1]
    assert str(os.getpid()) not in cmdline and "{" not in cmdline, cmdline
    assert str(os.getpid()) not in result.stdout, "the host's pid leaked (cmdline or cgroup name)"
    repository = os.path.dirname(os.path.dirname(os.path.abspath(trl_gptoss.__file__)))
    assert repository not in cmdline.replace(sys.executable, ""), "the repository's path leaked"


def test_the_call_joins_its_cgroups_without_seeing_any_cgroup_file(sandbox):
    if sandbox.cgroups is None:
        pytest.skip("the host gives us no cgroups")
    code = "import os\nprint(os.listdir('/.sandbox'))\nprint(open('/proc/self/cgroup').read())\n"
    lines = _lines(sandbox.run(code))
    expected = ["init.py", "zygote.py"] if sandbox.zygote else ["init.py"]
    assert sorted(eval(lines[0])) == expected, "a cgroup file (or anything else) is bound into the sandbox"  # noqa: S307
    joined = [line for line in lines[1:] if ":memory:" in line or ":pids:" in line]
    assert len(joined) == 2 and all("trl-gptoss-sandbox-" in line for line in joined), lines
