"""``PythonSession``: the stateful notebook GPT-OSS's builtin python description promises, in the real sandbox."""

import sys

import pytest

from trl_gptoss.tools import PythonSandbox, PythonSession, PythonTool, SandboxLimits
from trl_gptoss.tools.python_session import MAX_REPAIRS, notebook_program
from trl_gptoss.tools.python_tool import NOTEBOOK_BUILTIN_DESCRIPTION

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="runs the sandbox")

# Ends the process only when replayed: replays run with stdout swapped for a StringIO.
ON_REPLAY = "import io, os, posix, signal, sys\nif isinstance(sys.stdout, io.StringIO):\n    {}\nreplayed_past = 1"
PROCESS_ENDINGS = {
    "os._exit": "os._exit(0)",
    "posix._exit": "posix._exit(3)",
    "os.abort": "os.abort()",
    "kill-self": "os.kill(os.getpid(), 9)",
    "kill-group": "os.kill(0, 15)",
    "killpg": "os.killpg(os.getpgrp(), 9)",
    "raise_signal": "signal.raise_signal(signal.SIGTERM)",
    "exec": "os.execv(sys.executable, [sys.executable, '-c', ''])",
    "fork": "os.fork()",
}


@pytest.fixture(scope="module")
def tool():
    return PythonTool(PythonSandbox(SandboxLimits(wall_seconds=5.0, cpu_seconds=5)))


def test_state_persists_last_expression_echoes_and_replays_are_silent(tool):
    session = tool.new_session()
    assert isinstance(session, PythonSession)
    first = session.run("import os\nx = 6 * 7\nprint('side effect', flush=True)\nos.write(1, b'raw fd\\n')\nx")
    assert first.ok and first.stdout == "side effect\nraw fd\n42\n"  # the replay below must silence both
    second = session.run("y = x + 1\ny")
    assert second.ok and second.stdout == "43\n" and second.stderr == ""
    assert session.run("None").stdout == ""  # like a notebook, None is not echoed


def test_errors_show_only_the_models_code_and_the_state_before_them_survives(tool):
    session = PythonSession(tool)
    session.run("a = [1, 2]")
    failed = session.run("b = 5\na[7]")
    assert failed.exit_code == 1 and "IndexError" in failed.stderr
    assert 'File "<cell 1>", line 2' in failed.stderr and "a[7]" in failed.stderr and "_run" not in failed.stderr
    assert "notebook cell done" not in failed.stderr  # the host strips the program's done marker
    after = session.run("print(a, b)")  # notebook semantics: b was assigned before the error
    assert after.ok and after.stdout == "[1, 2] 5\n"
    syntax = session.run("def broken(:")
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr


def test_a_cell_that_hits_a_limit_is_not_replayed(tool):
    session = PythonSession(tool)
    session.run("n = 3")
    runaway = session.run("while True:\n    pass")
    assert runaway.timed_out and len(session.cells) == 1
    again = session.run("n * 2")
    assert again.ok and again.stdout == "6\n"


def test_a_cell_that_ends_its_process_is_not_recorded(tool):
    """``os._exit(0)`` at the end of a cell: before, every later call of the conversation printed nothing."""
    session = PythonSession(tool)
    session.run("a = 1")
    ended = session.run("import os\nb = 2\nprint('bye', flush=True)\nos._exit(0)")
    assert ended.exit_code == 0 and ended.stdout == "bye\n" and len(session.cells) == 1
    later = session.run("print(a)\n'b' in dir()")
    assert later.ok and later.stdout == "1\nFalse\n", later.render()


def test_a_cell_that_calls_sys_exit_is_replayed_without_ending_the_replay(tool):
    session = PythonSession(tool)
    exited = session.run("import sys\nc = 3\nsys.exit(4)")
    assert exited.exit_code == 4 and len(session.cells) == 1  # control came back: recorded
    later = session.run("c + 1")
    assert later.ok and later.stdout == "4\n"


@pytest.mark.parametrize("ending", list(PROCESS_ENDINGS.values()), ids=list(PROCESS_ENDINGS))
def test_a_replayed_cell_cannot_end_the_replay(tool, ending):
    """A recorded cell that ends the process only when it replays: the replay goes on with the next cell."""
    session = PythonSession(tool)
    session.run("a = 1")
    first = session.run(ON_REPLAY.format(ending))
    assert first.ok and len(session.cells) == 2
    later = session.run("print(a)\n'replayed_past' in dir()")
    assert later.ok and later.stdout == "1\nFalse\n", later.render()  # the cell stopped where it would have ended
    assert session.run("print(a + 1)").stdout == "2\n"


def test_process_calls_work_in_the_new_cell(tool):
    """The replay guards only act during replays: the new cell's own fork/kill/exit are the real ones."""
    session = PythonSession(tool)
    session.run("import os, signal")
    forked = session.run("pid = os.fork()\nif pid == 0:\n    os._exit(7)\nos.waitpid(pid, 0)[1] >> 8")
    assert forked.ok and forked.stdout == "7\n", forked.render()
    killed = session.run("os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.exit_code == -9 and len(session.cells) == 2


def test_sessions_are_independent(tool):
    one, two = PythonSession(tool), PythonSession(tool)
    one.run("secret = 1")
    leaked = two.run("secret")
    assert leaked.exit_code == 1 and "NameError" in leaked.stderr


def test_function_form_body_and_bad_input(tool):
    assert tool.code_from_body('{"code": "print(1)"}') == "print(1)"
    assert tool.code_from_body({"code": "print(1)"}) == "print(1)"
    assert tool.code_from_body("{1: 2}") == "{1: 2}"  # a dict literal is code
    with pytest.raises(ValueError, match="unknown arguments"):
        tool.code_from_body('{"code": "1", "extra": 2}')
    with pytest.raises(ValueError, match="must be str"):
        notebook_program([], b"print(1)")
    with pytest.raises(ValueError, match="PythonTool"):
        PythonSession(object())
    session = PythonSession(tool)
    assert session.call('{"code": "v = 9"}').ok and session.call("v").stdout == "9\n"


def test_files_on_the_promised_drive_persist_across_cells(tool):
    # The description says /mnt/data persists user files: each call is a fresh sandbox, the replay rebuilds them.
    assert "/mnt/data" in NOTEBOOK_BUILTIN_DESCRIPTION
    session = PythonSession(tool)
    assert session.run("open('/mnt/data/n.txt', 'w').write('41')").ok
    later = session.run("int(open('/mnt/data/n.txt').read()) + 1")
    assert later.ok and later.stdout == "42\n", later.render()


# Each ends the process (or arms something that will) only when replayed; an earlier in-process guard was
# bypassed by every one of them and the cell then silently disabled every later cell of the conversation.
_REPLAY_BYPASSES = {
    "main-globals": (
        "import __main__\n"
        "for value in vars(__main__).values():\n"
        "    if isinstance(value, list) and value == [True]:\n"
        "        value[0] = False  # the old guard's 'replaying' flag\n"
        "os._exit(0)"
    ),
    "exit-in-closure": (
        "real = os._exit\n"
        "for cell in getattr(os._exit, '__closure__', None) or ():\n"
        "    if getattr(cell.cell_contents, '__name__', '') == '_exit':\n"
        "        real = cell.cell_contents\n"
        "real(0)"
    ),
    "sigsegv": "import faulthandler\nfaulthandler._sigsegv()",
    "thread": "threading.Thread(target=lambda: (time.sleep(0.2), os._exit(0))).start()",
    "timer": "threading.Timer(0.2, os._exit, (0,)).start()",
    "itimer": "signal.setitimer(signal.ITIMER_REAL, 0.2)",
}
_DISARMED = ("timer", "itimer")  # cancelled after the replayed cell: the cell itself stays in the notebook


def _on_replay(code: str) -> str:
    body = "\n".join("    " + line for line in code.splitlines())
    return f"import io, os, signal, sys, threading, time\nif isinstance(sys.stdout, io.StringIO):\n{body}\nmark = 1"


@pytest.mark.parametrize("bypass", list(_REPLAY_BYPASSES), ids=list(_REPLAY_BYPASSES))
def test_no_replayed_cell_can_disable_the_cells_after_it(tool, bypass):
    session = PythonSession(tool)
    session.run("a = 1")
    assert session.run(_on_replay(_REPLAY_BYPASSES[bypass])).ok and len(session.cells) == 2
    later = session.run("import time\ntime.sleep(0.5)\nprint(a, 'mark' in dir())")  # a timer would fire
    kept = bypass in _DISARMED
    assert later.ok and later.stdout == f"1 {kept}\n", later.render()
    if not kept:
        assert "[sandbox] earlier cell(s) 1 stopped this notebook when replayed; dropped" in later.render()
        assert len(session.cells) == 2  # "a = 1" and the later cell; the bypass is gone
    again = session.run("print(a + 1)")
    assert again.ok and again.stdout == "2\n" and "[sandbox]" not in again.render(), again.render()


def test_a_cell_that_leaves_a_thread_running_is_not_recorded(tool):
    session = PythonSession(tool)
    session.run("import threading, time\nb = 2")
    left = session.run("c = 3\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\nc")
    assert left.ok and left.stdout == "3\n" and len(session.cells) == 1
    assert session.run("print(b, 'c' in dir())").stdout == "2 False\n"


def test_a_notebook_no_repair_can_save_is_reset_not_disabled(tool):
    session = PythonSession(tool)
    session.cells = [_on_replay("os._exit(0)")] * (MAX_REPAIRS + 1)  # more bad cells than one call repairs
    result = session.run("print('still works')")
    assert result.ok and result.stdout == "still works\n", result.render()
    assert "[sandbox] earlier cells stopped this notebook when replayed; it was reset" in result.render()
    assert session.cells == ["print('still works')"]


def test_markers_of_another_secret_are_left_alone(tool):
    session = PythonSession(tool)
    fake = "<notebook " + "ab" * 16 + " done>"
    result = session.run(f"import sys\nsys.stderr.write({fake!r})\nimport os\nos._exit(0)")
    assert fake in result.stderr and len(session.cells) == 0
