"""The ``python`` tool: model-written code run in a ``PythonSandbox``, as a notebook or call by call.

Two settings decide what the model is told and what runs, together, so the two cannot disagree:

- ``stateful`` (default): each conversation gets a ``PythonSession`` (``new_session()``) whose calls behave
  like notebook cells; ``False``: every call runs in a fresh interpreter.
- ``builtin`` (default): declared as GPT-OSS's builtin ``python`` tool in the system message; ``False``: as
  the function tool ``functions.python``. Calls to either recipient are served either way.

The description follows both: the stateful builtin tool reads exactly the text GPT-OSS was trained with
(``NOTEBOOK_BUILTIN_DESCRIPTION``, Harmony's builtin ``python`` namespace text); the stateless tool says it is
stateless. The tool owns these texts; the rollout loop hands ``description`` to the Harmony renderer.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from trl_gptoss.harmony.messages import PYTHON_NAMESPACE_DESCRIPTION
from trl_gptoss.tools.base import Tool
from trl_gptoss.tools.python_session import PythonSession
from trl_gptoss.tools.result import ToolResult
from trl_gptoss.tools.sandbox.runner import PythonSandbox

NOTEBOOK_BUILTIN_DESCRIPTION = PYTHON_NAMESPACE_DESCRIPTION  # what GPT-OSS was trained with
STATELESS_DESCRIPTION = (
    "Use this tool to execute Python code. The code runs in a fresh, stateless sandbox with no network "
    "access and a private temporary directory; nothing persists between calls. Print what you want to see: "
    "the reply contains stdout, then stderr (tracebacks), truncated when long. numpy and sympy are available "
    "when installed on the host."
)
NOTEBOOK_FUNCTION_DESCRIPTION = (
    "Use this tool to execute Python code in a stateful notebook: each call runs as a new cell of this "
    "conversation's notebook, so variables, imports, functions and files from earlier calls are still there. "
    "The reply contains stdout, then stderr (tracebacks), then the value of the cell's last expression when it "
    "is not None, truncated when long. There is no network access. numpy and sympy are available when "
    "installed on the host."
)


class PythonTool(Tool):
    """``python``: the body is raw code (Harmony builtin ``to=python``) or ``{"code": ...}`` (function form).

    Args:
        sandbox: the ``PythonSandbox`` that runs the code (default: one with default limits).
        max_chars: longest text the model sees per call through ``as_function`` (``ToolResult.render``).
        stateful: a conversation's calls share state like notebook cells (``new_session()``).
        builtin: declare it as GPT-OSS's builtin ``python`` tool rather than as ``functions.python``.
    """

    name = "python"
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source to run; print the results."}},
        "required": ["code"],
    }

    def __init__(
        self,
        sandbox: PythonSandbox | None = None,
        max_chars: int = 4000,
        *,
        stateful: bool = True,
        builtin: bool = True,
    ):
        super().__init__()
        for key, value in (("stateful", stateful), ("builtin", builtin)):
            if not isinstance(value, bool):
                raise ValueError(f"PythonTool({key}=...) must be True or False, got {value!r}")
        self.sandbox = sandbox if sandbox is not None else PythonSandbox()
        self.max_chars = max_chars
        self.stateful = stateful
        self.builtin_name = "python" if builtin else None

    @property
    def description(self) -> str:
        """What the model reads: notebook or stateless, in the builtin or the function wording."""
        if not self.stateful:
            return STATELESS_DESCRIPTION
        return NOTEBOOK_BUILTIN_DESCRIPTION if self.builtin_name else NOTEBOOK_FUNCTION_DESCRIPTION

    @property
    def recipients(self) -> tuple[str, ...]:
        return ("python", "functions.python")  # GPT-OSS writes `to=python` even when told functions.python

    def new_session(self):
        """A ``PythonSession`` (one conversation's notebook) when stateful; the tool itself otherwise."""
        return PythonSession(self) if self.stateful else self

    def configured(self, *, builtin: bool | None = None, stateful: bool | None = None) -> PythonTool:
        builtin = (self.builtin_name is not None) if builtin is None else builtin
        stateful = self.stateful if stateful is None else stateful
        if (builtin, stateful) == (self.builtin_name is not None, self.stateful):
            return self
        return PythonTool(self.sandbox, self.max_chars, stateful=stateful, builtin=builtin)

    def code_from_body(self, arguments: str | dict) -> str:
        """The code of a call: a JSON object with a ``code`` key (text or dict) is the function form, checked
        against the schema (``ValueError`` says what is wrong); any other text is raw code.

        (As Python such a JSON body would be a bare dict literal that does nothing, so nothing real is lost.)
        """
        if isinstance(arguments, str) and not _looks_like_code_object(arguments):
            return arguments
        return self.parse_arguments(arguments)["code"]

    def run_code(self, code: str) -> ToolResult:
        """Run ``code`` as one program in a fresh sandbox (no notebook, no echo)."""
        return self.sandbox.run(code)

    def call(self, arguments: str | dict) -> ToolResult:
        """Run one call body as one fresh program; conversations use ``new_session().call``."""
        return self.run_code(self.code_from_body(arguments))

    def _invoke(self, arguments: dict) -> ToolResult:
        return self.run_code(arguments["code"])

    def as_function(self) -> Callable[[str], str]:
        tool = self

        def python(code: str) -> str:
            """Execute Python code in a stateless sandbox and return its output (stdout, then stderr).

            Args:
                code: Python source to run; print the values you need.
            """
            return tool.run_code(code).render(tool.max_chars)

        return python


def _looks_like_code_object(body: str) -> bool:
    """True for a JSON object body with a ``code`` key."""
    stripped = body.strip()
    if not (stripped.startswith("{") and stripped.endswith("}")):
        return False
    try:
        parsed = json.loads(stripped)
    except json.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and "code" in parsed
