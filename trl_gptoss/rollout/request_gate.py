"""Send engine requests that become ready close together as one group, so they share engine steps.

An engine advances every request it holds by one token per step, and a step costs a large fixed part (the
weights are read, the scheduler and the sampler run) whatever the number of sequences in it. Conversations
that return from their tool calls one by one (a tool pool finishes calls in waves) would otherwise reach the
engine one by one, each adding steps in which it is nearly alone; the engine then spends more steps, and on a
host where the engine and the tools share CPU cores, those steps take CPU from the tools.

``RequestGate.generate`` holds a ready request until ``window`` seconds have passed since the first request
of its group became ready, or until no other unfinished conversation could join the group (each is waiting
here or already generating: only a conversation in a tool call, or between two awaits, is outside), then
sends the whole group at once. A request therefore waits at most ``window`` seconds, and not at all when
every conversation is ready together (the first turn). Requests, seeds and results are untouched; only the
moment a request is sent changes.
"""

from __future__ import annotations

import asyncio

from trl_gptoss.rollout.types import Generation, GenerationRequest


class RequestGate:
    """Wraps ``engine`` for ``conversations`` concurrent conversations of one batch; ``window=0`` sends every
    request at once (no grouping). Each conversation calls ``finished()`` once, when it ends."""

    def __init__(self, engine, conversations: int, window: float):
        self.engine, self.window = engine, window
        self.outside = conversations  # unfinished conversations neither waiting here nor generating
        self._pending: list[asyncio.Future] = []
        self._timer: asyncio.TimerHandle | None = None

    async def generate(self, request: GenerationRequest) -> Generation:
        if self.window <= 0:
            return await self.engine.generate(request)
        self.outside -= 1
        try:
            loop = asyncio.get_running_loop()
            released = loop.create_future()
            self._pending.append(released)
            if self._timer is None:
                self._timer = loop.call_later(self.window, self._release)
            if self.outside <= 0:
                self._release()
            await released
            return await self.engine.generate(request)
        finally:
            self.outside += 1

    def finished(self) -> None:
        """A conversation ended: it will never join a group, so a group waiting only for it goes now."""
        self.outside -= 1
        if self._pending and self.outside <= 0:
            self._release()

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        for released in pending:
            if not released.done():  # a cancelled conversation's future is already done
                released.set_result(None)
