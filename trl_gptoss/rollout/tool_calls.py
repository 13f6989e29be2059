"""Serve the tool calls of running rollouts off the event loop; what a call does is the tools' business.

``trl_gptoss.tools.ToolSet`` resolves the recipient, runs the tool (or the conversation's session of it) and
turns every failure into a ``ToolResult`` the model reads; this module only moves that work to a worker
thread, so other conversations keep generating meanwhile.

When more calls are waiting than there are workers, the call of the conversation that has made the most calls
so far goes first (ties: first come, first served). A batch ends with its longest conversation, and a
conversation deep into its tool calls is the likeliest to be that one: serving it first shortens the batch,
while a conversation making its first call loses at most one worker's turn. Results do not depend on the
order: each conversation's calls still run one after another on its own sessions.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from concurrent.futures import Executor

from trl_gptoss.harmony import ToolCall
from trl_gptoss.tools import ToolResult, ToolSession, ToolSet


class ToolBox:
    """The tools of one ``run_rollouts`` call; at most ``workers`` calls run at once on ``executor`` (which must
    have at least that many threads), the others wait in priority order."""

    def __init__(self, toolset: ToolSet, *, executor: Executor, workers: int):
        if workers < 1:
            raise ValueError(f"ToolBox needs workers >= 1, got {workers}")
        self.toolset, self.executor = toolset, executor
        self.free = workers
        self._waiting: list[tuple[int, int, asyncio.Future]] = []  # heap of (-priority, arrival, future)
        self._arrivals = itertools.count()

    def new_sessions(self) -> dict[str, ToolSession]:
        """One conversation's tool state (a notebook per stateful tool)."""
        return self.toolset.new_sessions()

    async def run(self, call: ToolCall, sessions: dict[str, ToolSession], *, priority: int = 0) -> ToolResult:
        """Run one call on a worker thread once a worker is free (higher ``priority`` first); never raises for
        anything the tool does."""
        await self._acquire(priority)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self.executor, self.toolset.call, call.recipient, call.arguments, sessions
            )
        finally:
            self._release()

    async def _acquire(self, priority: int) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (-priority, next(self._arrivals), turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # the worker was handed over just as this call was cancelled: pass it on
            raise

    def _release(self) -> None:
        while self._waiting:
            *_, turn = heapq.heappop(self._waiting)
            if not turn.done():  # a cancelled waiter's future is already done
                turn.set_result(None)  # the worker passes straight to it
                return
        self.free += 1
