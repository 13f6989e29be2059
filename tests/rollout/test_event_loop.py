"""The one event-loop owner: a coroutine run here, or on a loop thread, ends as under ``asyncio.run``."""

import asyncio
import concurrent.futures
import threading

import pytest

from trl_gptoss.rollout.event_loop import LoopThread, run_to_completion


def _parked(log: list):
    """A task parked until cancelled, whose clean-up awaits (how connection pools close at loop end)."""

    async def park_and_clean_up():
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            await asyncio.sleep(0)
            log.append("closed")

    async def job():
        asyncio.get_running_loop().create_task(park_and_clean_up())
        await asyncio.sleep(0)
        return ["r"]

    return job


def test_run_to_completion_finishes_every_task_left_on_the_loop():
    log = []
    assert run_to_completion(_parked(log)()) == ["r"]
    assert log == ["closed"]


def test_run_to_completion_is_refused_inside_a_running_loop():
    async def inside():
        with pytest.raises(RuntimeError, match="inside a running event loop"):
            run_to_completion(asyncio.sleep(0))

    run_to_completion(inside())


def test_a_loop_thread_settles_its_future_and_close_finishes_tasks_and_stops_the_thread():
    log, loop = [], LoopThread("event-loop-test-thread")
    task, future = loop.submit(_parked(log))
    assert future.result(10) == ["r"]
    loop.close()
    assert log == ["closed"]
    assert not [t for t in threading.enumerate() if t.name == "event-loop-test-thread"]
    loop.close()  # idempotent


def test_a_cancelled_task_settles_its_future_after_it_unwound():
    log, loop = [], LoopThread("event-loop-test-thread")

    async def slow():
        try:
            await asyncio.sleep(30)
        finally:
            log.append("unwound")

    task, future = loop.submit(slow)
    loop.cancel(task)
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(10)
    assert future.cancelled() and log == ["unwound"]
    loop.close()


def test_an_error_of_the_task_reaches_the_future():
    loop = LoopThread("event-loop-test-thread")

    async def failing():
        raise ConnectionError("refused")

    _, future = loop.submit(failing)
    with pytest.raises(ConnectionError, match="refused"):
        future.result(10)
    loop.close()
