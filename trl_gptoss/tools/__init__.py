"""Tools the model may call during rollouts; ``python`` runs model-written code in a sandbox.

Public names: ``Tool``, ``PythonTool``, ``PythonSandbox``, ``SandboxLimits``, ``ToolResult``,
``detect_isolation``, ``run_tool_calls``.
"""

from trl_gptoss.tools.base import Tool
from trl_gptoss.tools.dispatch import run_tool_calls
from trl_gptoss.tools.isolation import detect_isolation
from trl_gptoss.tools.python_tool import PythonTool
from trl_gptoss.tools.result import SandboxLimits, ToolResult
from trl_gptoss.tools.sandbox import PythonSandbox

__all__ = [
    "PythonSandbox",
    "PythonTool",
    "SandboxLimits",
    "Tool",
    "ToolResult",
    "detect_isolation",
    "run_tool_calls",
]
