"""ToolBox: calls beyond the free workers wait, and the conversation with the most calls so far goes first."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.rollout.loop_helpers import ok_result
from trl_gptoss.harmony import ToolCall
from trl_gptoss.rollout.tool_calls import ToolBox


class Recorder:
    """A stand-in ToolSet whose calls record their order; a call named ``block`` waits for ``gate``."""

    def __init__(self):
        self.order, self.gate = [], threading.Event()

    def call(self, recipient, arguments, sessions):
        if recipient == "block":
            self.gate.wait(10)
        self.order.append(recipient)
        return ok_result(recipient)

    def new_sessions(self):
        return {}


def _call(name):
    return ToolCall(name=name, arguments="{}", recipient=name, channel="commentary")


def test_waiting_calls_run_deepest_conversation_first_ties_in_arrival_order():
    tools = Recorder()

    async def go():
        with ThreadPoolExecutor(1) as pool:
            box = ToolBox(tools, executor=pool, workers=1)
            first = asyncio.create_task(box.run(_call("block"), {}))
            await asyncio.sleep(0.05)  # the only worker is busy from here on
            waiting = []
            for name, priority in [("p0", 0), ("p2-a", 2), ("p1", 1), ("p2-b", 2), ("p5", 5)]:
                waiting.append(asyncio.create_task(box.run(_call(name), {}, priority=priority)))
                await asyncio.sleep(0)
            tools.gate.set()
            results = await asyncio.gather(first, *waiting)
            return [r.stdout for r in results], box.free

    results, free = asyncio.run(go())
    assert results == ["block", "p0", "p2-a", "p1", "p2-b", "p5"]  # each caller gets its own result
    assert tools.order == ["block", "p5", "p2-a", "p2-b", "p1", "p0"]
    assert free == 1


def test_a_call_cancelled_while_waiting_does_not_run_or_keep_a_worker():
    tools = Recorder()

    async def go():
        with ThreadPoolExecutor(1) as pool:
            box = ToolBox(tools, executor=pool, workers=1)
            first = asyncio.create_task(box.run(_call("block"), {}))
            await asyncio.sleep(0.05)
            doomed = asyncio.create_task(box.run(_call("doomed"), {}, priority=9))
            after = asyncio.create_task(box.run(_call("after"), {}))
            await asyncio.sleep(0)
            doomed.cancel()
            tools.gate.set()
            await first
            assert (await asyncio.wait_for(after, 5)).stdout == "after"
            with pytest.raises(asyncio.CancelledError):
                await doomed
            return box.free

    assert asyncio.run(go()) == 1
    assert tools.order == ["block", "after"]


def test_a_call_cancelled_as_the_worker_is_handed_to_it_passes_the_worker_on():
    async def go():
        box = ToolBox(Recorder(), executor=None, workers=1)
        await box._acquire(0)  # the only worker is taken
        doomed = asyncio.create_task(box._acquire(9))
        after = asyncio.create_task(box._acquire(0))
        await asyncio.sleep(0)
        box._release()  # hands the worker to `doomed` ...
        doomed.cancel()  # ... which is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await doomed
        await asyncio.wait_for(after, 1)  # the worker went on to the next waiter
        box._release()
        return box.free

    assert asyncio.run(go()) == 1


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers >= 1"):
        ToolBox(Recorder(), executor=None, workers=0)
