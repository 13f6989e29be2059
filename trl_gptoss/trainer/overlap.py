"""One-step-off-policy overlap (``max_staleness=1``): the next batch's rollouts run on a background thread while
the current step trains.

Timeline of one process (``v`` = the global step whose weights the engine holds):

    step u:   [take batch u (sampled with v = u-1)] [push v = u] [start batch u+1 in background] [loss, optimizer]
    step u+1: [take batch u+1 (v = u)]              [push v = u+1] [start batch u+2] ...

A push only happens while no background generation runs (the job of batch u was taken -- finished -- before it),
so every trajectory comes from exactly one weight version, recorded with the batch. The first batch of a run (and
of each epoch, and after a resume) is sampled in the foreground with the current weights: lag 0.

``NextBatchPeek`` reads the data loader one update ahead (the trainer needs the next batch's prompts before its
optimizer step); ``BackgroundRollouts`` owns the thread and its event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

# How long closing waits for a cancelled generation to unwind (running tool calls finish within their own limits).
CLOSE_TIMEOUT_S = 60.0


@dataclass
class RolloutJob:
    """One background generation: the prompts it samples, the weight version the engine held, its outcome."""

    prompts: list
    weight_version: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    task: asyncio.Task | None = None
    started: float = field(default_factory=time.perf_counter)
    seconds: float | None = None  # wall time of the generation itself, set when it ends
    rollouts: list | None = None


class BackgroundRollouts:
    """Runs at most one rollout job at a time on a daemon thread with its own event loop.

    ``start(prompts, version, make_coroutine)`` schedules ``make_coroutine()`` (e.g. ``arun_rollouts(...)``);
    ``take(prompts)`` waits for the job and returns it when it sampled exactly these prompts (``None`` when
    there is no job or it sampled others: the caller generates in the foreground); an exception of the job is
    raised there, in the training loop, naming what failed. ``cancel()`` stops a running job and returns once
    its task has unwound (conversations cancelled, tool pool shut down).
    """

    def __init__(self, name: str = "trl-gptoss-rollouts"):
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.job: RolloutJob | None = None

    @property
    def busy(self) -> bool:
        """A job was started and not taken or cancelled (it may have finished already)."""
        return self.job is not None

    def start(self, prompts: list, weight_version: int, make_coroutine: Callable[[], Awaitable[list]]) -> None:
        if self.job is not None:
            raise RuntimeError("a background rollout job is still pending; take() or cancel() it first")
        loop = self._ensure_loop()
        job = RolloutJob(prompts=prompts, weight_version=weight_version)
        created = threading.Event()

        def create_task():
            job.task = loop.create_task(make_coroutine())
            job.task.add_done_callback(lambda task: _settle(job, task))
            created.set()

        loop.call_soon_threadsafe(create_task)
        created.wait()
        self.job = job

    def take(self, prompts: list) -> RolloutJob | None:
        """The finished job for ``prompts`` (waits for it), or ``None`` after cancelling a job for other prompts."""
        job, self.job = self.job, None
        if job is None:
            return None
        if job.prompts != prompts:
            self._cancel(job)
            return None
        try:
            job.rollouts = job.future.result()
        except BaseException as error:
            raise RuntimeError(
                f"the background generation (max_staleness=1, weights of step {job.weight_version}) failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        return job

    def wait(self) -> None:
        """Block until the pending job (if any) has finished sampling; the job stays pending for ``take``."""
        if self.job is not None:
            concurrent.futures.wait([self.job.future])

    def cancel(self) -> None:
        job, self.job = self.job, None
        if job is not None:
            self._cancel(job)

    def close(self) -> None:
        """Cancel any job, finish every task still on the loop (connection pools close theirs when
        cancelled, as under ``asyncio.run``), then stop the thread. Idempotent; ``start`` opens a new loop."""
        self.cancel()
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_finish_tasks(), loop).result(CLOSE_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()

    def _cancel(self, job: RolloutJob) -> None:
        self._loop.call_soon_threadsafe(job.task.cancel)
        # Settled by the task's done-callback: after the task unwound, not merely when asked to. Cancelled,
        # failed or timed out, the job is dropped either way.
        with contextlib.suppress(Exception):
            job.future.result(CLOSE_TIMEOUT_S)

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name=self._name, daemon=True)
            self._thread.start()
        return self._loop


async def _finish_tasks() -> None:
    """What ``asyncio.run`` does before closing its loop: cancel the other tasks, wait for them, close async
    generators."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


def _settle(job: RolloutJob, task: asyncio.Task) -> None:
    job.seconds = time.perf_counter() - job.started
    if task.cancelled():
        job.future.cancel()
    elif task.exception() is not None:
        job.future.set_exception(task.exception())
    else:
        job.future.set_result(task.result())


class NextBatchPeek:
    """Reads the trainer's epoch iterator one item ahead, and gives the item back at the next read.

    ``read(iterator, count)`` returns an iterator that yields the held-back item first (when it came from this
    same iterator: a new epoch's iterator drops it) and then ``iterator`` itself.
    """

    def __init__(self):
        self._source = None
        self._item = None

    def read(self, iterator):
        source, item, self._source, self._item = self._source, self._item, None, None
        if source is iterator:
            return itertools.chain([item], iterator)
        return iterator

    def peek(self, iterator):
        """The next item of ``iterator`` (kept for the next ``read``), or ``None`` at its end."""
        try:
            item = next(iterator)
        except StopIteration:
            return None
        self._source, self._item = iterator, item
        return item
