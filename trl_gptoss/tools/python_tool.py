"""The ``python`` tool: stateless execution of model-written code in a ``PythonSandbox``."""

from __future__ import annotations

import json
from collections.abc import Callable

from trl_gptoss.tools.base import Tool
from trl_gptoss.tools.result import ToolResult
from trl_gptoss.tools.sandbox.runner import PythonSandbox

PYTHON_TOOL_DESCRIPTION = (
    "Use this tool to execute Python code. The code runs in a fresh, stateless sandbox with no network "
    "access and a private temporary directory; nothing persists between calls. Print what you want to see: "
    "the reply contains stdout, then stderr (tracebacks), truncated when long. numpy and sympy are available "
    "when installed on the host."
)


class PythonTool(Tool):
    """``python``: the body is raw code (Harmony builtin ``to=python``) or ``{"code": ...}`` (function form).

    Args:
        sandbox: the ``PythonSandbox`` that runs the code (default: one with default limits).
        max_chars: longest text the model sees per call (``ToolResult.render``).
    """

    name = "python"
    description = PYTHON_TOOL_DESCRIPTION
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source to run; print the results."}},
        "required": ["code"],
    }

    def __init__(self, sandbox: PythonSandbox | None = None, max_chars: int = 4000):
        super().__init__()
        self.sandbox = sandbox if sandbox is not None else PythonSandbox()
        self.max_chars = max_chars

    def call(self, arguments: str | dict) -> ToolResult:
        """Raw code (builtin form) or JSON/dict ``{"code": ...}`` (function form)."""
        if isinstance(arguments, str) and not _looks_like_code_object(arguments):
            return self.sandbox.run(arguments)
        return super().call(arguments)

    def _invoke(self, arguments: dict) -> ToolResult:
        return self.sandbox.run(arguments["code"])

    def as_function(self) -> Callable[[str], str]:
        tool = self

        def python(code: str) -> str:
            """Execute Python code in a stateless sandbox and return its output (stdout, then stderr).

            Args:
                code: Python source to run; print the values you need.
            """
            return tool.sandbox.run(code).render(tool.max_chars)

        return python


def _looks_like_code_object(body: str) -> bool:
    """True for a JSON object body with a ``code`` key: the function form, checked against the schema.

    (As Python such a body would be a bare dict literal that does nothing, so nothing real is lost.)
    """
    stripped = body.strip()
    if not (stripped.startswith("{") and stripped.endswith("}")):
        return False
    try:
        parsed = json.loads(stripped)
    except json.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and "code" in parsed
