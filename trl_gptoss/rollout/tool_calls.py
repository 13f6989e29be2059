"""Serve the tool calls of running rollouts off the event loop; what a call does is the tools' business.

``trl_gptoss.tools.ToolSet`` resolves the recipient, runs the tool (or the conversation's session of it) and
turns every failure into a ``ToolResult`` the model reads; this module only moves that work to a worker
thread, so other conversations keep generating meanwhile.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from trl_gptoss.harmony import ToolCall
from trl_gptoss.tools import ToolResult, ToolSession, ToolSet


class ToolBox:
    """The tools of one ``run_rollouts`` call; calls run on ``executor`` (its worker count bounds them)."""

    def __init__(self, toolset: ToolSet, *, executor: Executor):
        self.toolset = toolset
        self.executor = executor

    def new_sessions(self) -> dict[str, ToolSession]:
        """One conversation's tool state (a notebook per stateful tool)."""
        return self.toolset.new_sessions()

    async def run(self, call: ToolCall, sessions: dict[str, ToolSession]) -> ToolResult:
        """Run one call on a worker thread; never raises for anything the tool does."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.toolset.call, call.recipient, call.arguments, sessions)
