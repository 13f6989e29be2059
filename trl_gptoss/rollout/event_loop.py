"""The one owner of asyncio event loops in trl-gptoss: run a coroutine to the end here, or on a loop thread.

Both end a loop the way ``asyncio.run`` does -- cancel the tasks left on it, wait for them (connection pools close
theirs when cancelled), close async generators -- so a batch that failed or was cancelled leaves nothing running.
``asyncio.run`` itself is not used: since Python 3.11 it turns SIGINT into a cancellation of the main task, and a
training job was seen to run on after Ctrl-C during generation. Here SIGINT raises ``KeyboardInterrupt`` where it
lands, as everywhere else in training.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine

# How long closing a loop thread waits for its tasks to unwind (running tool calls finish within their own limits).
CLOSE_TIMEOUT_S = 60.0


async def finish_tasks() -> None:
    """What ``asyncio.run`` does before closing its loop: cancel the other tasks, wait for them, close async
    generators."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


def run_to_completion(coroutine: Coroutine):
    """Run ``coroutine`` on a new event loop in this thread and return its result; the loop ends as under
    ``asyncio.run`` (without its Ctrl-C handler). Refused inside a running loop (``await`` the coroutine there)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        name = getattr(coroutine, "__qualname__", "the coroutine")
        coroutine.close()
        raise RuntimeError(f"{name}(...) was run to completion inside a running event loop; use `await {name}(...)`")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coroutine)
    finally:
        try:
            loop.run_until_complete(finish_tasks())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def run_blocking(make_coroutine):
    """``make_coroutine()`` run to its end for a blocking caller (one HTTP call of a weight push, the health probe):
    on a private loop that is never made this thread's current loop (the caller's, if any, stays as it was), or,
    when this thread already runs a loop, on a helper thread, the caller blocking either way."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="run-blocking") as pool:
            return pool.submit(run_blocking, make_coroutine).result()
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(make_coroutine())
    finally:
        try:
            loop.run_until_complete(finish_tasks())
        finally:
            loop.close()


class LoopThread:
    """An event loop running on a daemon thread: ``submit(make_coroutine)`` creates a task there and returns it
    with a ``concurrent.futures.Future`` settled when the task ends (after it unwound, when cancelled).
    ``close()`` finishes every task as ``asyncio.run`` would, stops the thread; a later ``submit`` opens a new one."""

    def __init__(self, name: str):
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def submit(self, make_coroutine) -> tuple[asyncio.Task, concurrent.futures.Future]:
        loop = self._ensure_loop()
        future: concurrent.futures.Future = concurrent.futures.Future()
        created: list[asyncio.Task] = []
        ready = threading.Event()

        def create_task():
            try:
                task = loop.create_task(make_coroutine())
                task.add_done_callback(lambda done: _settle(future, done))
                created.append(task)
            finally:
                ready.set()

        loop.call_soon_threadsafe(create_task)
        ready.wait()
        if not created:
            raise RuntimeError(f"{self._name}: the coroutine could not be created on the loop thread")
        return created[0], future

    def cancel(self, task: asyncio.Task) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(task.cancel)

    def close(self) -> None:
        """Finish every task still on the loop, then stop the thread. Idempotent."""
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(finish_tasks(), loop).result(CLOSE_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name=self._name, daemon=True)
            self._thread.start()
        return self._loop


def _settle(future: concurrent.futures.Future, task: asyncio.Task) -> None:
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())
