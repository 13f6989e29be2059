"""Tools the model may call during rollouts; ``python`` runs model-written code in a sandbox.

Public names: ``TOOLS`` (name → tool class, the one registry) and ``build_tools``; ``Tool`` and
``ToolSession`` (the protocol), ``PythonTool`` and ``PythonSession`` (its per-conversation notebook);
``ToolSet`` and ``run_tool_calls`` (the one dispatcher), ``error_result``; ``ToolResult``; the sandbox:
``PythonSandbox``, ``SandboxLimits``, ``detect_isolation``, ``UserNamespaceError``.
"""

from trl_gptoss.tools.base import Tool, ToolSession
from trl_gptoss.tools.dispatch import ToolSet, error_result, run_tool_calls
from trl_gptoss.tools.python_session import PythonSession
from trl_gptoss.tools.python_tool import PythonTool
from trl_gptoss.tools.registry import TOOLS, build_tools
from trl_gptoss.tools.result import ToolResult
from trl_gptoss.tools.sandbox import PythonSandbox, SandboxLimits, UserNamespaceError, detect_isolation

__all__ = [
    "TOOLS",
    "PythonSandbox",
    "PythonSession",
    "PythonTool",
    "SandboxLimits",
    "Tool",
    "ToolResult",
    "ToolSession",
    "ToolSet",
    "UserNamespaceError",
    "build_tools",
    "detect_isolation",
    "error_result",
    "run_tool_calls",
]
