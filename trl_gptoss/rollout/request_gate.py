"""Send engine requests that become ready close together as one group, so they share engine steps.

An engine advances every request it holds by one token per step, and a step costs a large fixed part (the
weights are read, the scheduler and the sampler run) whatever the number of sequences in it. Conversations
that return from their tool calls one by one (a tool pool finishes calls in waves) would otherwise reach the
engine one by one, each adding steps in which it is nearly alone; the engine then spends more steps, and on a
host where the engine and the tools share CPU cores, those steps take CPU from the tools.

``RequestGate.generate`` holds a ready request, and sends the whole group it belongs to at once when either

- no other unfinished conversation could join the group (each is waiting here or already generating: only a
  conversation in a tool call, or between two awaits, is outside), or
- ``window`` seconds have passed since the first request of the group became ready **and** the tool workers
  are not all busy (fewer conversations are in tool calls, running or queued, than there are workers).

While every tool worker is busy, the tools are what the batch waits for: a conversation sent to the engine
then can only finish early (which ends nothing sooner while others are still in their calls) or make another
call, which waits for a worker anyway, and its engine steps take CPU from the running tools. So the group
waits until a worker would be left without a call, then goes together with everyone who came back meanwhile.
The wait is bounded by the tool calls in flight: each one that ends either joins the group or frees a worker.
Without tool workers named (``tool_workers=None``) only the window and the first rule apply.

A request is not held at all when every conversation is ready together (the first turn). Requests, seeds and
results are untouched; only the moment a request is sent changes.
"""

from __future__ import annotations

import asyncio
import contextlib

from trl_gptoss.rollout.types import Generation, GenerationRequest


class RequestGate:
    """Wraps ``engine`` for ``conversations`` concurrent conversations of one batch; ``window=0`` sends every
    request at once (no grouping). Each conversation calls ``finished()`` once, when it ends, and runs each tool
    call inside ``in_tool_call()``; ``tool_workers`` is the number of tool calls that run at once (``None``:
    the gate does not look at the tools)."""

    def __init__(self, engine, conversations: int, window: float, tool_workers: int | None = None):
        if tool_workers is not None and tool_workers < 1:
            raise ValueError(f"RequestGate needs tool_workers >= 1 or None, got {tool_workers}")
        self.engine, self.window, self.tool_workers = engine, window, tool_workers
        self.outside = conversations  # unfinished conversations neither waiting here nor generating
        self.in_tools = 0  # conversations in a tool call (running or waiting for a worker)
        self._pending: list[asyncio.Future] = []
        self._timer: asyncio.TimerHandle | None = None
        self._window_over = False

    async def generate(self, request: GenerationRequest) -> Generation:
        if self.window <= 0:
            return await self.engine.generate(request)
        self.outside -= 1
        try:
            loop = asyncio.get_running_loop()
            released = loop.create_future()
            self._pending.append(released)
            if self._timer is None and not self._window_over:
                self._timer = loop.call_later(self.window, self._window_ended)
            self._release_if_due()
            await released
            return await self.engine.generate(request)
        finally:
            self.outside += 1

    @contextlib.contextmanager
    def in_tool_call(self):
        """Around one tool call of a conversation (its wait for a worker included). Leaving it releases nothing
        by itself: the conversation's next ``generate`` (or ``finished``) follows without an await in between
        and decides then, so it joins the group it frees."""
        self.in_tools += 1
        try:
            yield
        finally:
            self.in_tools -= 1

    def finished(self) -> None:
        """A conversation ended: it will never join a group, so a group waiting only for it goes now."""
        self.outside -= 1
        self._release_if_due()

    def tool_workers_busy(self) -> bool:
        return self.tool_workers is not None and self.in_tools >= self.tool_workers

    def _window_ended(self) -> None:
        self._timer = None
        self._window_over = True
        self._release_if_due()

    def _release_if_due(self) -> None:
        if not self._pending:
            return
        if self.outside <= 0 or (self._window_over and not self.tool_workers_busy()):
            self._release()

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._window_over = False
        pending, self._pending = self._pending, []
        for released in pending:
            if not released.done():  # a cancelled conversation's future is already done
                released.set_result(None)
