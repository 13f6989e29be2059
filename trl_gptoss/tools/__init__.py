"""Tools the model may call during rollouts; ``python`` runs model-written code in a sandbox.

Public names: ``Tool``, ``PythonTool``, ``PythonSandbox``, ``SandboxLimits``, ``ToolResult``,
``detect_isolation``, ``run_tool_calls``, ``UserNamespaceError``. The tool protocol lives in ``base``,
``python_tool``, ``dispatch`` and ``result``; the sandbox in the ``sandbox`` package.
"""

from trl_gptoss.tools.base import Tool
from trl_gptoss.tools.dispatch import run_tool_calls
from trl_gptoss.tools.python_tool import PythonTool
from trl_gptoss.tools.result import ToolResult
from trl_gptoss.tools.sandbox import PythonSandbox, SandboxLimits, UserNamespaceError, detect_isolation

__all__ = [
    "PythonSandbox",
    "PythonTool",
    "SandboxLimits",
    "Tool",
    "ToolResult",
    "UserNamespaceError",
    "detect_isolation",
    "run_tool_calls",
]
