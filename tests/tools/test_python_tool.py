"""The tool abstraction: schema, argument checking, both Harmony call forms, TRL's function form."""

import sys
import time

import pytest
from transformers.utils import get_json_schema

from tests.tools.helpers import TIGHT
from trl_gptoss.tools import PythonSandbox, PythonTool, SandboxLimits, Tool, ToolResult, run_tool_calls


@pytest.fixture(scope="module")
def tool():
    return PythonTool(PythonSandbox(SandboxLimits(**TIGHT)), max_chars=300)


def test_schema_is_the_harmony_description(tool):
    assert tool.to_harmony_dict() == {
        "name": "python",
        "description": tool.description,
        "parameters": tool.parameters,
    }
    assert tool.to_openai_dict() == {"type": "function", "function": tool.schema}
    assert tool.parameters["required"] == ["code"]


def test_settings_are_checked_and_configured_copies_keep_the_sandbox(tool):
    with pytest.raises(ValueError, match="stateful"):
        PythonTool(tool.sandbox, stateful="yes")
    assert tool.configured() is tool and tool.configured(builtin=True, stateful=True) is tool
    function = tool.configured(builtin=False)
    assert function.builtin_name is None and function.stateful and function.sandbox is tool.sandbox
    assert function.max_chars == tool.max_chars and tool.builtin_name == "python"


@pytest.mark.skipif(sys.platform != "linux", reason="runs the sandbox")
@pytest.mark.parametrize(
    "body",
    ["print(2 + 3)", '{"code": "print(2 + 3)"}', {"code": "print(2 + 3)"}],
    ids=["builtin-raw-code", "function-json", "function-dict"],
)
def test_both_call_forms_run_the_code(tool, body):
    result = tool.call(body)
    assert result.ok and result.stdout == "5\n"


@pytest.mark.skipif(sys.platform != "linux", reason="runs the sandbox")
def test_the_trl_function_form(tool):
    assert not hasattr(tool, "call_many"), "run_tool_calls is the one way to run calls concurrently"
    python = tool.as_function()
    schema = get_json_schema(python)["function"]
    assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]
    assert python("print('x' * 1000)").count("x") < 300
    assert "ZeroDivisionError" in python("1/0")


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"code": 1}', "must be a JSON string"),
        ('{"cmd": "ls"}', "missing arguments"),
        ("[1]", "JSON object"),
        ('{"code": "x", "extra": 1}', "unknown arguments"),
        ("{not json", "not valid JSON"),
    ],
    ids=["wrong-type", "missing", "not-object", "unknown", "bad-json"],
)
def test_bad_arguments_raise_value_error(tool, body, message):
    with pytest.raises(ValueError, match=message):
        tool.parse_arguments(body)


def test_custom_tool_checks_its_declaration():
    class Add(Tool):
        name = "add"
        description = "Add two integers."
        parameters = {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        }

        def _invoke(self, arguments):
            return ToolResult(str(arguments["a"] + arguments["b"]), "", 0, False, False, 0.0, "none")

    assert Add().call('{"a": 2, "b": 40}').stdout == "42"
    with pytest.raises(ValueError, match="must be a JSON integer"):
        Add().call({"a": True, "b": 1})

    class BadName(Add):
        name = "functions.add"

    with pytest.raises(ValueError, match="Tool name"):
        BadName()


@pytest.mark.skipif(sys.platform != "linux", reason="runs the sandbox")
def test_run_tool_calls_in_parallel_with_errors_as_messages(tool):
    from trl_gptoss.harmony import ToolCall

    calls = [ToolCall(name="python", arguments="import time\ntime.sleep(0.4)\nprint('a')", recipient="python")]
    calls += [
        ("python", "import time\ntime.sleep(0.4)\nprint('b')"),
        ("python", '{"code": "print(3)"}'),
        ("calculator", "{}"),
        ("python", '{"code": 3}'),
    ]
    start = time.monotonic()
    messages = run_tool_calls(calls, [tool], max_chars=300)
    elapsed = time.monotonic() - start
    assert [m["name"] for m in messages] == ["python", "python", "python", "calculator", "python"]
    assert [m["content"] for m in messages[:3]] == ["a", "b", "3"]
    assert "no tool named 'functions.calculator'" in messages[3]["content"]
    assert "must be a JSON string" in messages[4]["content"]
    assert elapsed < sum(0.4 for _ in range(2)) + 0.4 + 1.0  # the two sleeps overlap
    with pytest.raises(ValueError, match="unique"):
        run_tool_calls([], [tool, tool])


def test_harmony_renders_the_tool_in_the_developer_message(tool):
    from trl_gptoss.harmony import build_messages
    from trl_gptoss.harmony.render import developer_text

    tool = PythonTool(tool.sandbox, builtin=False)  # declared as functions.python: the function wording
    assert "\n" not in tool.description and "stateful notebook" in tool.description
    developer = build_messages([{"role": "user", "content": "hi"}], tools=[tool])[1]
    text = developer_text(developer.content)
    assert "namespace functions {" in text and "type python = (_: {" in text
    assert "code: string," in text and tool.description in text
