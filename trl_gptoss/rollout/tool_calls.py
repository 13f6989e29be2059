"""Serve the tool calls of running rollouts: resolve the recipient, run the tool off the event loop, never raise.

Harmony addresses a tool two ways: ``to=python`` (GPT-OSS's builtin python tool, raw code body) and
``to=functions.NAME`` (a function tool, JSON body). A ``PythonTool`` serves both. Whatever goes wrong
(unknown recipient, bad arguments, a tool that raises or returns garbage) becomes a ``ToolResult`` whose text
explains the error to the model; ``ToolResult.ok`` is False for those, and for sandbox runs that failed.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from trl_gptoss.harmony import ToolCall
from trl_gptoss.rollout.python_session import PythonSession, python_code_from_body
from trl_gptoss.tools import PythonTool, Tool, ToolResult

BUILTIN_PYTHON = "python"


def error_result(text: str) -> ToolResult:
    """A result that carries only an error message (shown to the model as the tool's reply)."""
    return ToolResult(
        stdout="", stderr=text, exit_code=None, timed_out=False, truncated=False, wall_time=0.0, isolation="none"
    )


class ToolBox:
    """The tools of one ``run_rollouts`` call; calls run on ``executor`` (its worker count bounds them)."""

    def __init__(self, tools, *, executor: Executor, python_stateful: bool):
        tools = list(tools or ())
        for tool in tools:
            if not isinstance(tool, Tool):
                raise ValueError(f"tools must be trl_gptoss.tools.Tool instances, got {type(tool).__name__}")
        self.by_name = {tool.name: tool for tool in tools}
        if len(self.by_name) != len(tools):
            raise ValueError(f"tool names must be unique, got {[t.name for t in tools]}")
        self.executor = executor
        self.python_stateful = python_stateful

    @property
    def recipients(self) -> list[str]:
        """Every recipient a call may address (``python`` for a PythonTool, ``functions.NAME`` for all)."""
        builtin = [BUILTIN_PYTHON] if isinstance(self.by_name.get(BUILTIN_PYTHON), PythonTool) else []
        return builtin + [f"functions.{name}" for name in self.by_name]

    def resolve(self, call: ToolCall) -> Tool | None:
        if call.recipient == BUILTIN_PYTHON:
            return self.by_name.get(BUILTIN_PYTHON)
        if call.namespace == "functions":
            return self.by_name.get(call.name)
        return None

    def new_sessions(self) -> dict[str, PythonSession]:
        """Per-conversation notebook state for every PythonTool (empty when ``python_stateful`` is off)."""
        if not self.python_stateful:
            return {}
        return {name: PythonSession(tool) for name, tool in self.by_name.items() if isinstance(tool, PythonTool)}

    async def run(self, call: ToolCall, sessions: dict[str, PythonSession]) -> ToolResult:
        """Run one call on a worker thread, so other conversations keep generating meanwhile."""
        tool = self.resolve(call)
        session = sessions.get(tool.name) if tool is not None else None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._execute, tool, call, session)

    def _execute(self, tool: Tool | None, call: ToolCall, session: PythonSession | None) -> ToolResult:
        if tool is None:
            return error_result(f"Error: no tool named {call.recipient!r}; available: {', '.join(self.recipients)}.")
        try:
            if session is not None:
                result = session.run(python_code_from_body(tool, call.arguments))
            else:
                result = tool.call(call.arguments)
        except ValueError as exc:  # the tools' way of rejecting arguments
            return error_result(f"Error: {exc}")
        except Exception as exc:  # a tool bug must not end the rollout batch; the model sees what happened
            return error_result(f"Error: tool {tool.name!r} failed: {type(exc).__name__}: {exc}")
        if not isinstance(result, ToolResult):
            return error_result(f"Error: tool {tool.name!r} returned {type(result).__name__}, not a ToolResult.")
        return result
