"""Hostile corpus, part 3: kernel surface (seccomp), the per-call CPU cap, and hosts without user namespaces."""

import ast
import os
import shutil
import subprocess
import sys

import pytest

from tests.tools.helpers import LAUNCHERS, TIGHT, sandbox_for
from trl_gptoss.tools import PythonSandbox, SandboxLimits, detect_isolation
from trl_gptoss.tools.sandbox.seccomp import build_filter

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the sandbox uses Linux namespaces"),
    pytest.mark.skipif(detect_isolation() != "namespaces", reason="needs user namespaces (bubblewrap isolation)"),
]

# (what, Python statement returning the errno the call failed with, or 0 on success)
SYSCALL_PROBES = {
    "unshare(CLONE_NEWUSER)": "libc.unshare(0x10000000)",
    "clone(CLONE_NEWNET)": "libc.syscall(NR['clone'], 0x40000000 | 17, 0, 0, 0, 0)",
    "socket(AF_NETLINK)": "libc.socket(16, 3, 0)",
    "socket(AF_VSOCK)": "libc.socket(40, 1, 0)",
    "socket(AF_PACKET)": "libc.socket(17, 3, 0)",
    "ptrace(PTRACE_ATTACH, 1)": "libc.ptrace(16, 1, 0, 0)",
    "io_uring_setup": "libc.syscall(NR['io_uring_setup'], 1, 0)",
    "keyctl(GET_KEYRING_ID)": "libc.syscall(NR['keyctl'], 0, -4, 0)",
    "bpf": "libc.syscall(NR['bpf'], 0, 0, 0)",
    "mount": "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)",
}


# Refused since the hostile-input review (issue 40), by number here so the probe does not read the filter's table:
# modify_ldt (x86-64 only; Docker's default profile refuses it), memfd_secret (ENOSYS where the kernel has it
# off), kcmp (compares other processes' files), process_madvise (advice on another process's memory).
_MORE_PROBES = {
    "x86_64": {
        "modify_ldt(read)": "libc.syscall(154, 0, 0, 0)",
        "memfd_secret": "libc.syscall(447, 0)",
        "kcmp": "libc.syscall(312, libc.getpid(), libc.getpid(), 0, 0, 0)",
        "process_madvise": "libc.syscall(440, -1, 0, 0, 0, 0)",
    },
    "aarch64": {
        "memfd_secret": "libc.syscall(447, 0)",
        "kcmp": "libc.syscall(272, libc.getpid(), libc.getpid(), 0, 0, 0)",
        "process_madvise": "libc.syscall(440, -1, 0, 0, 0, 0)",
    },
}


@pytest.fixture(scope="module", params=LAUNCHERS)
def sandbox(request):
    sandbox = sandbox_for(request.param, SandboxLimits(**TIGHT))
    yield sandbox
    sandbox.close()


def _probe_program(statements: dict[str, str]) -> str:
    import platform

    from trl_gptoss.tools.sandbox import seccomp

    numbers = seccomp._ARCHES[platform.machine()][1]
    lines = ["import ctypes", "libc = ctypes.CDLL(None, use_errno=True)", f"NR = {numbers!r}", "out = {}"]
    for name, call in statements.items():
        lines.append(f"ret = {call}")
        lines.append(f"out[{name!r}] = ctypes.get_errno() if ret < 0 else 0")
    lines.append("print(out)")
    return "\n".join(lines) + "\n"


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="no syscall table")
def test_seccomp_refuses_namespace_netlink_vsock_ptrace_io_uring_and_friends(sandbox):
    probes = {**SYSCALL_PROBES, **_MORE_PROBES[os.uname().machine]}
    result = sandbox.run(_probe_program(probes))
    assert result.exit_code == 0, result.stderr
    errnos = ast.literal_eval(result.stdout)
    refused = {name: os.strerror(e) for name, e in errnos.items() if e in (1, 97)}  # EPERM, EAFNOSUPPORT
    assert refused.keys() == probes.keys(), f"allowed: { {n: errnos[n] for n in set(probes) - set(refused)} }"


def test_seccomp_keeps_what_python_programs_use(sandbox):
    code = (
        "import multiprocessing as mp, socket, threading, subprocess, sys\n"
        "a, b = socket.socketpair()\n"
        "a.sendall(b'ok'); print(b.recv(2).decode())\n"
        "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
        "with mp.get_context('fork').Pool(2) as pool:\n"
        "    print(pool.map(abs, [-1, -2]))\n"
        "print(subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True, text=True).stdout.strip())\n"
    )
    result = sandbox.run(code)
    assert result.ok, result.stderr
    assert result.stdout.split("\n")[:4] == ["ok", "thread", "[1, 2]", "7"]


def test_filter_is_a_whole_number_of_bpf_instructions():
    for machine in ("x86_64", "aarch64"):
        prog = build_filter(machine)
        assert len(prog) % 8 == 0 and 0 < len(prog) // 8 < 4096
    with pytest.raises(ValueError, match="seccomp=False"):
        build_filter("riscv64")


def test_cpu_of_the_whole_call_is_capped(sandbox):
    """Four processes spin for 1.5 s of wall time; with cpu_cores=0.1 the call gets ~0.15 s of CPU in all
    (``RLIMIT_CPU`` alone is per process and would allow up to all cores for the whole wall time)."""
    if not sandbox.cpu_quota:
        pytest.skip("the host gives us no cpu cgroup; see docs/tools_and_rewards.md")
    capped = PythonSandbox(SandboxLimits(**{**TIGHT, "cpu_cores": 0.1}), zygote=sandbox.zygote)
    code = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        "        end = time.monotonic() + 1.5\n"
        "        while time.monotonic() < end:\n"
        "            pass\n"
        "        os.write(w, f'{time.process_time():.3f}\\n'.encode())\n"
        "        os._exit(0)\n"
        "for _ in range(4):\n"
        "    os.wait()\n"
        "os.close(w)\n"
        "print(sum(float(x) for x in os.read(r, 4096).split()))\n"
    )
    result = capped.run(code)
    capped.close()
    assert result.ok, result.stderr
    assert float(result.stdout) < 0.1 * 1.5 * 1.5 + 0.1, f"the call used {result.stdout.strip()} s of CPU"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_start_up_fails_clearly_where_user_namespaces_are_disabled():
    """Inside a user namespace whose ``user.max_user_namespaces`` is 0 (what some clusters set host-wide),
    constructing the sandbox must fail at once, saying how to enable them or which isolation to choose."""
    program = (
        "open('/proc/sys/user/max_user_namespaces', 'w').write('0')\n"
        "from trl_gptoss.tools import PythonSandbox, UserNamespaceError, detect_isolation\n"
        "assert detect_isolation() == 'process', detect_isolation()\n"
        "try:\n"
        "    PythonSandbox()\n"
        "except UserNamespaceError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for hint in ("unshare(CLONE_NEWUSER)", "user.max_user_namespaces", "isolation='process'"):
        assert out.stdout.count(hint) == 1, out.stdout
