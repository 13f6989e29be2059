"""The one registry of tools by name: ``TOOLS`` maps a name (as in ``GptOssGRPOConfig.tool_names``) to a class.

Adding a tool is one file (a ``Tool`` subclass) and one line here. Every class builds with no arguments.
"""

from __future__ import annotations

from trl_gptoss.tools.base import Tool
from trl_gptoss.tools.python_tool import PythonTool

TOOLS: dict[str, type[Tool]] = {
    "python": PythonTool,
}


def build_tools(names) -> list[Tool]:
    """One instance of each tool named in ``names`` (default settings), in order."""
    names = list(names or ())
    unknown = [name for name in names if name not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tool names {unknown}; available: {sorted(TOOLS)} (trl_gptoss.tools.TOOLS)")
    return [TOOLS[name]() for name in names]
