"""The one dispatcher: resolve a call's recipient to a tool, run it, and never raise.

A call is anything with ``.recipient`` (``trl_gptoss.harmony.ToolCall``: ``python`` or ``functions.NAME``)
and ``.arguments`` (the raw body: code for the builtin ``python`` tool, JSON text for functions), an object
with ``.name`` and ``.arguments``, or a ``(name, arguments)`` pair (a bare name means ``functions.NAME``
unless a tool answers that recipient itself, as ``python`` does).

Whatever goes wrong (unknown recipient, arguments that fail the schema, a tool that raises anything, e.g.
an ``OSError`` from the sandbox, or returns something else than a ``ToolResult``) becomes a ``ToolResult``
whose text explains the error to the model (``ok`` is False), as TRL's own tool loop does: one bad call
never aborts a rollout batch.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from trl_gptoss.tools.base import Tool, ToolSession
from trl_gptoss.tools.result import ToolResult


def error_result(text: str) -> ToolResult:
    """A result that carries only an error message (shown to the model as the tool's reply)."""
    return ToolResult(
        stdout="", stderr=text, exit_code=None, timed_out=False, truncated=False, wall_time=0.0, isolation="none"
    )


class ToolSet:
    """The tools of one rollout batch, addressed by Harmony recipient.

    ``new_sessions()`` gives one conversation's state (tool name → ``ToolSession``); ``call`` serves one
    call with it (or with a fresh session per call when none is given). Thread-safe as long as each
    conversation's sessions are used by one call at a time.
    """

    def __init__(self, tools=()):
        self.tools = list(tools or ())
        for tool in self.tools:
            if not isinstance(tool, Tool):
                raise ValueError(f"tools must be trl_gptoss.tools.Tool instances, got {type(tool).__name__}")
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        self._by_recipient: dict[str, Tool] = {}
        for tool in self.tools:
            for recipient in tool.recipients:
                if recipient in self._by_recipient:
                    raise ValueError(
                        f"tools {self._by_recipient[recipient].name!r} and {tool.name!r} both answer {recipient!r}"
                    )
                self._by_recipient[recipient] = tool

    @property
    def builtins(self) -> list[Tool]:
        """Tools declared in the system message (as Harmony builtins, by ``builtin_name``)."""
        return [tool for tool in self.tools if tool.builtin_name]

    @property
    def functions(self) -> list[Tool]:
        """Tools declared in the developer message as ``functions.NAME``."""
        return [tool for tool in self.tools if not tool.builtin_name]

    @property
    def recipients(self) -> list[str]:
        return list(self._by_recipient)

    def resolve(self, recipient: str) -> Tool | None:
        return self._by_recipient.get(recipient)

    def new_sessions(self) -> dict[str, ToolSession]:
        """One conversation's state: a session per tool (stateless tools serve as their own session)."""
        return {tool.name: tool.new_session() for tool in self.tools}

    def call(self, recipient: str, arguments, sessions: dict[str, ToolSession] | None = None) -> ToolResult:
        """Serve one call; every failure comes back as an ``error_result`` the model can read."""
        tool = self.resolve(recipient)
        if tool is None:
            available = ", ".join(self.recipients) or "none"
            return error_result(f"Error: no tool named {recipient!r}; available: {available}.")
        try:
            session = sessions[tool.name] if sessions is not None else tool.new_session()
            result = session.call(arguments)
        except ValueError as exc:  # the tools' way of rejecting arguments
            return error_result(f"Error: {exc}")
        except Exception as exc:  # a tool or sandbox failure must not end the batch; the model sees what happened
            return error_result(f"Error: tool {tool.name!r} failed: {type(exc).__name__}: {exc}")
        if not isinstance(result, ToolResult):
            return error_result(f"Error: tool {tool.name!r} returned {type(result).__name__}, not a ToolResult.")
        return result

    def recipient_of(self, call) -> tuple[str, str, str | dict]:
        """``(recipient, name, arguments)`` of a call in any accepted form (see the module docstring)."""
        if isinstance(call, tuple) and len(call) == 2:
            name, arguments = call
        elif hasattr(call, "name") and hasattr(call, "arguments"):
            name, arguments = call.name, call.arguments
            if isinstance(getattr(call, "recipient", None), str):
                return call.recipient, name, arguments
        else:
            raise ValueError(f"A tool call is a (name, arguments) pair or has .name/.arguments, got {call!r}.")
        if not isinstance(name, str):
            raise ValueError(f"A tool call's name must be a str, got {name!r}.")
        recipient = name if "." in name or name in self._by_recipient else f"functions.{name}"
        return recipient, name, arguments


def run_tool_calls(calls, tools: list[Tool], max_chars: int = 4000, max_workers: int = 8) -> list[dict]:
    """Run ``calls`` in parallel, each as the first call of its own conversation (a fresh session); return
    ``{"role": "tool", "name": ..., "content": ...}`` messages in the order of ``calls``.

    Python calls share the sandbox pool (``PythonSandbox.max_concurrency`` bounds them); ``max_workers``
    bounds how many calls are in flight at once.
    """
    toolset = ToolSet(tools)
    parts = [toolset.recipient_of(c) for c in calls]
    if not parts:
        return []

    def message(part) -> dict:
        recipient, name, arguments = part
        return toolset.call(recipient, arguments).to_message(name, max_chars)

    with ThreadPoolExecutor(max_workers=min(max_workers, len(parts))) as pool:
        return list(pool.map(message, parts))
