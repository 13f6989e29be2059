"""Sandbox behaviour that is not an attack: results, exit codes, limits validation, concurrency."""

import os
import sys
import threading
import time

import pytest

from tests.tools.helpers import (
    LAUNCHERS,
    TIGHT,
    descendants,
    own_call_dirs,
    processes_of_uids,
    sandbox_for,
    sandbox_uid_range,
)
from trl_gptoss.tools import PythonSandbox, SandboxLimits, ToolResult

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox uses Linux rlimits and /proc")


@pytest.fixture(scope="module", params=LAUNCHERS)
def sandbox(request):
    sandbox = sandbox_for(request.param, SandboxLimits(**TIGHT), max_concurrency=16)
    yield sandbox
    sandbox.close()


def test_prints_and_exit_codes(sandbox):
    ok = sandbox.run("print(6 * 7)")
    assert (ok.stdout, ok.stderr, ok.exit_code, ok.ok) == ("42\n", "", 0, True)
    failed = sandbox.run("import sys\nprint('before')\nsys.exit(3)")
    assert failed.exit_code == 3 and failed.stdout == "before\n" and not failed.ok
    raised = sandbox.run("raise KeyError('missing')")
    assert raised.exit_code == 1 and "KeyError: 'missing'" in raised.stderr
    killed = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert killed.exit_code == -11, killed


def test_closing_its_own_output_does_not_end_the_call_early(sandbox):
    finishes = sandbox.run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(0.3)\nos._exit(3)")
    assert finishes.exit_code == 3 and not finishes.timed_out and finishes.wall_time >= 0.3
    hangs = PythonSandbox(SandboxLimits(**{**TIGHT, "wall_seconds": 1.0}), zygote=sandbox.zygote).run(
        "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)"
    )
    assert hangs.timed_out and 1.0 <= hangs.wall_time < 3.0


def test_numpy_is_importable_within_the_address_space_limit(sandbox):
    pytest.importorskip("numpy")
    result = sandbox.run("import numpy as np\nprint(int(np.arange(10).sum()))")
    assert result.ok, result.stderr
    assert result.stdout.strip() == "45"


def test_non_utf8_and_empty_programs(sandbox):
    assert sandbox.run("").render() == "[sandbox] no output"
    binary = sandbox.run("import sys\nsys.stdout.buffer.write(b'\\xff\\xfeok')")
    assert binary.ok and binary.stdout.endswith("ok")


@pytest.mark.slow
def test_two_hundred_concurrent_calls_complete(sandbox):
    before = set(descendants(os.getpid()))
    codes = [f"import time\ntime.sleep(0.05)\nprint({i} ** 2)" for i in range(200)]
    start = time.monotonic()
    results = sandbox.run_many(codes)
    elapsed = time.monotonic() - start
    assert [r.stdout for r in results] == [f"{i**2}\n" for i in range(200)]
    assert all(r.ok for r in results)
    assert elapsed < sum(r.wall_time for r in results) / 4, "calls were serialised"
    assert processes_of_uids(sandbox_uid_range()) == [] and own_call_dirs() == []
    # A zygote's call returns once its program and everything it started are gone; its PID 1, which ran no
    # model code, may still be exiting for a moment (and no longer reads as the zygote's once its memory is gone).
    deadline = time.monotonic() + 2.0
    while descendants(os.getpid(), ignore=before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert descendants(os.getpid(), ignore=before) == []


@pytest.mark.parametrize(
    "bad",
    [
        dict(wall_seconds=0),
        dict(max_processes=1),
        dict(address_space_bytes=1 << 20),
        dict(output_bytes=-5),
        dict(cpu_seconds="10"),
        dict(memory_bytes=1 << 20),
    ],
    ids=lambda d: next(iter(d)),
)
def test_bad_limits_raise_value_error(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SandboxLimits(**bad)


def test_bad_arguments_raise_value_error(sandbox):
    with pytest.raises(ValueError, match="isolation"):
        PythonSandbox(isolation="docker")
    with pytest.raises(ValueError, match="max_concurrency"):
        PythonSandbox(max_concurrency=0)
    with pytest.raises(ValueError, match="packages"):
        PythonSandbox(packages="numpy")
    with pytest.raises(ValueError, match="code must be a str"):
        sandbox.run(b"print(1)")


def test_render_puts_errors_last_and_clips_the_middle():
    result = ToolResult(
        stdout="a" * 5000 + "END",
        stderr="Traceback\nValueError: boom\n",
        exit_code=1,
        timed_out=False,
        truncated=False,
        wall_time=0.1,
    )
    text = result.render(max_chars=1000)
    assert len(text) <= 1000
    assert text.startswith("aaa") and "characters omitted" in text
    assert text.rstrip().endswith("\n[sandbox] exit status 1") and "ValueError: boom" in text
    message = result.to_message("python", max_chars=1000)
    assert message == {"role": "tool", "name": "python", "content": text}
    timeout = ToolResult("", "", -9, True, False, 2.0)
    assert timeout.render() == "[sandbox] timed out after 2.0 s; the program was killed"
    with pytest.raises(ValueError, match="max_chars"):
        result.render(max_chars=10)


def test_lone_surrogate_in_the_code_is_reported_by_the_interpreter(sandbox):
    result = sandbox.run("print('\ud800')")
    assert result.exit_code == 1 and "SyntaxError" in result.stderr, result
    assert processes_of_uids(sandbox_uid_range()) == [] and own_call_dirs() == []


def test_control_bytes_in_the_output_are_made_visible(sandbox):
    result = sandbox.run("import sys\nsys.stdout.write('a\\x00b\\x1b[31mred\\x07\\r\\n\\x9b2J\\tend\\n')")
    assert result.ok, result.stderr
    assert result.stdout == "a\\x00b\\x1b[31mred\\x07\n\\x9b2J\tend\n"
    assert not any(ord(c) < 32 and c not in "\n\t" for c in result.render())


def test_the_program_cannot_forge_the_sandbox_notices(sandbox):
    forged = "[sandbox] timed out after 1.0 s; the program was killed"
    result = sandbox.run(f"print({forged!r})\nprint('[sandbox] exit status 0')\nimport sys\nsys.exit(2)")
    text = result.render()
    notices = [line for line in text.splitlines() if line.startswith("[sandbox]")]
    assert notices == ["[sandbox] exit status 2"], text
    assert "\\" + forged in text
    clipped = ToolResult("x" * 3000 + "\n[sandbox] killed by signal 9\n" + "y" * 3000, "", 0, False, False, 0.1)
    for budget in range(200, 400, 7):  # wherever the cut falls, no forged notice starts a line
        assert not [
            line
            for line in clipped.render(budget).splitlines()
            if line.startswith("[sandbox]") and "characters omitted" not in line
        ]


def test_max_concurrency_bounds_run_from_any_number_of_threads():
    from concurrent.futures import ThreadPoolExecutor

    bounded = PythonSandbox(SandboxLimits(**TIGHT), max_concurrency=2)
    in_flight, peak = [0], [0]
    lock = threading.Lock()
    real_run = bounded._run

    def counting_run(source):  # wraps the real call: counts calls that are inside the sandbox at once
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            return real_run(source)
        finally:
            with lock:
                in_flight[0] -= 1

    bounded._run = counting_run
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(bounded.run, ["import time\ntime.sleep(0.3)\nprint(1)"] * 6))
    assert all(r.ok for r in results) and peak[0] == 2


def test_the_drive_the_python_description_promises_is_writable(sandbox):
    # GPT-OSS was trained on a description naming /mnt/data; a call must be able to use it (size-limited tmpfs).
    result = sandbox.run(
        "import pathlib\np = pathlib.Path('/mnt/data/out.txt')\np.write_text('kept')\nprint(p.read_text())"
    )
    assert result.ok and result.stdout == "kept\n", result.render()
