"""The one dispatcher (``ToolSet``, ``run_tool_calls``): recipients, sessions, and errors as replies."""

import os
import shutil
import sys
import tempfile

import pytest

from tests.rollout.loop_helpers import AddTool, BrokenTool, MissingFileTool, ok_result
from tests.tools.helpers import TIGHT
from trl_gptoss.harmony import ToolCall
from trl_gptoss.tools import PythonSandbox, PythonSession, PythonTool, SandboxLimits, Tool, ToolSet, run_tool_calls


class NotAResultTool(AddTool):
    name = "sloppy"

    def _invoke(self, arguments):
        return "42"


@pytest.fixture(scope="module")
def python():
    return PythonTool(PythonSandbox(SandboxLimits(**TIGHT)), max_chars=300)


def test_recipients_and_declaration(python):
    tools = ToolSet([AddTool(), python])
    assert tools.recipients == ["functions.add", "python", "functions.python"]
    assert tools.functions == tools.tools[:1] and tools.builtins == [python]
    function_python = PythonTool(python.sandbox, builtin=False)
    assert ToolSet([function_python]).functions == [function_python]
    assert ToolSet([function_python]).resolve("python") is function_python  # GPT-OSS writes to=python anyway
    assert tools.resolve("add") is None and tools.resolve("functions.nope") is None


def test_sessions_follow_each_tool(python):
    add = AddTool()
    with pytest.raises(ValueError, match="names must be unique"):
        ToolSet([add, python, PythonTool(python.sandbox, stateful=False, builtin=False)])
    sessions = ToolSet([add, python]).new_sessions()
    assert sessions["add"] is add and isinstance(sessions["python"], PythonSession)
    stateless = PythonTool(python.sandbox, stateful=False)
    assert ToolSet([stateless]).new_sessions() == {"python": stateless}
    assert ToolSet([python]).new_sessions()["python"] is not ToolSet([python]).new_sessions()["python"]


def test_two_tools_cannot_answer_one_recipient(python):
    class OtherPython(AddTool):
        name = "py"
        builtin_name = "python"

    with pytest.raises(ValueError, match="both answer 'python'"):
        ToolSet([python, OtherPython()])
    with pytest.raises(ValueError, match="Tool instances"):
        ToolSet([{"name": "add"}])


@pytest.mark.parametrize(
    "recipient, body, error",
    [
        ("functions.nope", "{}", "Error: no tool named 'functions.nope'; available: functions.add, functions.broken"),
        ("functions.add", '{"a": 1}', "Error: Tool 'add': missing arguments ['b']"),
        ("functions.add", '{"a": 1, "b": ', "Error: Tool 'add': arguments are not valid JSON"),
        ("functions.add", '{"a": 1, "b": "2"}', "Error: Tool 'add': argument 'b' must be a JSON integer"),
        ("functions.broken", "{}", "Error: tool 'broken' failed: RuntimeError: disk on fire"),
        ("functions.read_log", "{}", "Error: tool 'read_log' failed: FileNotFoundError: [Errno 2]"),
        ("functions.sloppy", '{"a": 1, "b": 2}', "Error: tool 'sloppy' returned str, not a ToolResult."),
    ],
    ids=["unknown-tool", "missing-arg", "bad-json", "wrong-type", "tool-raises", "tool-raises-oserror", "not-a-result"],
)
def test_every_failure_is_a_reply_never_an_exception(recipient, body, error):
    extra = [MissingFileTool(), NotAResultTool()] if recipient in ("functions.read_log", "functions.sloppy") else []
    tools = ToolSet([AddTool(), BrokenTool(), *extra])
    result = tools.call(recipient, body, tools.new_sessions())
    assert not result.ok and result.isolation == "none" and result.stdout == ""
    assert result.render().startswith(error), result.render()


@pytest.fixture
def vanishing_interpreter():
    """A path to this host's system python (world-readable, as process isolation needs) that the test removes."""
    directory = tempfile.mkdtemp(prefix="trl-gptoss-vanishing-", dir="/tmp")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "python3")
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs a world-readable /usr/bin/python3 for process isolation")
    os.symlink(os.path.realpath("/usr/bin/python3"), path)
    yield path
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(sys.platform != "linux", reason="runs the sandbox")
def test_an_oserror_from_the_sandbox_becomes_a_reply(vanishing_interpreter):
    """A sandbox whose interpreter disappeared raises FileNotFoundError at launch: the model reads it as the
    tool's reply, in the rollout dispatcher and in ``run_tool_calls``, and the other calls still run."""
    sandbox = PythonSandbox(SandboxLimits(**TIGHT), isolation="process", python_executable=vanishing_interpreter)
    python = PythonTool(sandbox, stateful=False)
    assert python.call("print(1)").stdout == "1\n"
    os.remove(vanishing_interpreter)
    with pytest.raises(OSError):
        python.call("print(1)")
    for tool in (python, PythonTool(sandbox)):  # stateless and notebook session
        tools = ToolSet([tool])
        result = tools.call("python", "print(1)", tools.new_sessions())
        assert not result.ok and result.render().startswith("Error: tool 'python' failed: FileNotFoundError: ")
    messages = run_tool_calls([("python", "print(1)"), ("add", '{"a": 1, "b": 2}')], [python, AddTool()])
    assert messages[0]["content"].startswith("Error: tool 'python' failed: FileNotFoundError")
    assert messages[1]["content"] == "3"


@pytest.mark.skipif(sys.platform != "linux", reason="runs the sandbox")
def test_run_tool_calls_reports_errors_in_order_and_runs_calls_in_parallel(python):
    calls = [ToolCall(name="python", arguments="print('a')", recipient="python")]
    calls += [
        ("python", '{"code": "print(3)"}'),
        ("calculator", "{}"),
        ("python", '{"code": 3}'),
        ("read_log", "{}"),
        ToolCall(name="add", arguments='{"a": 2, "b": 40}', recipient="functions.add", namespace="functions"),
    ]
    messages = run_tool_calls(calls, [python, MissingFileTool(), AddTool()], max_chars=300)
    assert [m["name"] for m in messages] == ["python", "python", "calculator", "python", "read_log", "add"]
    assert [messages[i]["content"] for i in (0, 1, 5)] == ["a", "3", "42"]
    assert "no tool named 'functions.calculator'" in messages[2]["content"]
    assert "must be a JSON string" in messages[3]["content"]
    assert "FileNotFoundError" in messages[4]["content"]


def test_a_stateless_tool_is_its_own_session():
    add = AddTool()
    assert add.new_session() is add and add.recipients == ("functions.add",) and add.builtin_name is None
    assert isinstance(add, Tool) and add.configured(builtin=True, stateful=True) is add
    assert ok_result("x").ok
