"""Run the tool calls of a rollout batch concurrently and turn them into the tool messages the model sees.

A call is anything with ``.name`` and ``.arguments`` (``trl_gptoss.harmony.ToolCall``: ``arguments`` is
raw code for the builtin ``python`` tool, JSON text for ``functions.NAME``) or a ``(name, arguments)`` pair.
A failing call never raises here: an unknown tool or bad arguments become an error message for the model,
as TRL's own tool loop does, so one malformed call cannot abort a rollout batch.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from trl_gptoss.tools.base import Tool


def _name_and_arguments(call) -> tuple[str, str | dict]:
    if isinstance(call, tuple) and len(call) == 2:
        return call
    if hasattr(call, "name") and hasattr(call, "arguments"):
        return call.name, call.arguments
    raise ValueError(f"A tool call is a (name, arguments) pair or has .name/.arguments, got {call!r}.")


def _message(name: str, tool: Tool | None, arguments, max_chars: int) -> dict:
    """The tool message for one call: the tool's rendered result, or the error the model must fix."""
    if tool is None:
        return {"role": "tool", "name": name, "content": f"Error: no tool named {name!r}."}
    try:
        return tool.call(arguments).to_message(name, max_chars)
    except ValueError as exc:
        return {"role": "tool", "name": name, "content": f"Error: {exc}"}


def run_tool_calls(calls, tools: list[Tool], max_chars: int = 4000, max_workers: int = 8) -> list[dict]:
    """Run ``calls`` in parallel (each tool's own limits apply); return ``{"role": "tool", ...}`` messages.

    Python calls share the sandbox pool (``PythonSandbox.max_concurrency`` bounds them); ``max_workers``
    bounds how many calls are in flight at once. Messages come back in the order of ``calls``.
    """
    by_name = {tool.name: tool for tool in tools}
    if len(by_name) != len(tools):
        raise ValueError(f"Tool names must be unique, got {[t.name for t in tools]}.")
    pairs = [_name_and_arguments(c) for c in calls]
    if not pairs:
        return []
    with ThreadPoolExecutor(max_workers=min(max_workers, len(pairs))) as pool:
        return list(pool.map(lambda p: _message(p[0], by_name.get(p[0]), p[1], max_chars), pairs))
