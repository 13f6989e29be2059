"""``Sampler``: the one owner of a GRPO run's sampling timeline.

It holds the engine (built from ``ENGINE_KINDS``), the server it started, the weight version the engine holds (the
global step whose weights were pushed last) and, with ``max_staleness: 1``, the background job with its event loop.
Two rules hold here and nowhere else:

- **push before sample**: a batch is sampled with the weights of the step that asks for it (``sample``), or -- a
  batch prefetched in the background -- with those of the step that started it, one behind; the version is
  returned with the rollouts and never guessed.
- **no push while sampling**: a push first waits for the background job to finish sampling (every process for
  its own, then all together), so every trajectory comes from exactly one weight version.

Timeline of one process with ``max_staleness: 1`` (``v`` = the version the engine holds)::

    step u:   [take batch u (sampled with v = u-1)] [push v = u] [start batch u+1 in background] [loss, optimizer]
    step u+1: [take batch u+1 (v = u)]              [push v = u+1] [start batch u+2] ...

The first batch of a run (and of each epoch, and after a resume) is sampled in the foreground with the current
weights: lag 0. The background job is keyed by the step it is for; its prompts must also equal the asking batch's
(a guard: a job for other prompts is cancelled and the batch sampled afresh).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import time
from dataclasses import dataclass, field

from trl_gptoss.rollout.event_loop import CLOSE_TIMEOUT_S, LoopThread, run_to_completion
from trl_gptoss.rollout.loop import arun_rollouts
from trl_gptoss.rollout.routes import RouteShape
from trl_gptoss.rollout.weights.names import unwrap
from trl_gptoss.trainer.checks import as_conversation
from trl_gptoss.trainer.rollouts import rollout_config
from trl_gptoss.trainer.sampling.engines import ENGINE_KINDS
from trl_gptoss.trainer.sampling.read_ahead import NextBatchPeek


@dataclass
class SampledBatch:
    """One process's rollouts of a batch and the global step whose weights sampled them (``version``).
    ``waited_s``: how long ``sample`` generated or waited for them; ``background_s``: the wall time of the
    background generation that sampled them (``None``: sampled in the foreground)."""

    rollouts: list
    version: int
    waited_s: float
    background_s: float | None = None


@dataclass
class _Job:
    """A background generation: the step whose batch it samples, its prompts, the version the engine held."""

    for_step: int
    prompts: list
    version: int
    task: object = None
    future: concurrent.futures.Future | None = None
    seconds: float | None = field(default=None)  # set when the generation ends


class Sampler:
    """Samples a trainer's batches: ``sample(prompts, step)``, ``prefetch(prompts, step)``, ``push(step)``,
    ``end_run()``, ``close()``.

    ``policy()``: the model to push (the trainer's, unwrapped from DDP/FSDP wrappers but possibly sharded);
    ``world``: its accelerator (``process_index``, ``wait_for_everyone``); ``record(name, seconds)``: where the
    ``weight_push``, ``generation`` (what ``sample`` took), ``generation_background`` and ``tool_calls`` (summed
    over conversations) phases are timed. Pushes are collective: every process calls ``sample``/``prefetch`` for
    every batch, and rank 0 sends.
    """

    def __init__(self, args, policy, tokenizer, *, tools, system, world, record):
        kind = ENGINE_KINDS[args.rollout_backend]
        built = kind.build(args, policy(), tokenizer)
        self.engine, self._release = built.engine, built.release
        self.overlaps = bool(args.max_staleness)  # the config refused it for kinds that may not overlap
        self.version: int | None = None  # global step whose weights the engine holds (None: none pushed yet)
        self.last: SampledBatch | None = None  # this process's latest batch, for inspection; no hook reads it
        self.tools, self.system = tools, system  # what every conversation is rendered with
        self._args, self._policy, self._tokenizer, self._world, self._record = args, policy, tokenizer, world, record
        self._generate_every = args.steps_per_generation * args.num_iterations
        self._loop = LoopThread("trl-gptoss-rollouts")
        self._job: _Job | None = None
        self._peek = NextBatchPeek()
        self._read_ahead: list | None = None  # prompts of the next generation batch, read, not started yet
        if args.routing_replay == "rollout":
            self._enable_routes(policy())

    def _enable_routes(self, policy) -> None:
        """Ask the engine for every request's routes; its routers must be the policy's (layers, top-k, experts)."""
        try:
            served, trained = self.engine.enable_routes(), RouteShape.of_model(unwrap(policy, peft=True))
            if served != trained:
                raise ValueError(
                    f"routing_replay='rollout': the rollout engine's routers are {served}, the policy's {trained}; "
                    "serve the policy's checkpoint"
                )
        except BaseException:
            self.close()  # the server this sampler started, if any
            raise

    # -- the timeline ---------------------------------------------------------------------------------------
    def sample(self, prompts: list, step: int, *, train: bool = True, settings: dict | None = None) -> SampledBatch:
        """This process's rollouts of ``prompts``, the batch trained at global step ``step``: the background job
        started for it (waits for it), else sampled now with the weights of ``step`` (pushed first if older).
        Evaluation batches (``train=False``) never take a training batch's job; ``settings`` replace fields of
        their ``RolloutConfig`` (an evaluation's temperature and seed)."""
        prompts = [as_conversation(p) for p in prompts]
        job = self._take(prompts, step) if train and self._job is not None else None
        if job is None:
            self.push(step)
            start = time.perf_counter()
            rollouts = self._run_now(prompts, step, settings)
            batch = SampledBatch(rollouts, step, time.perf_counter() - start)
        else:
            batch = job
            self._record("generation_background", batch.background_s)
        self._record("generation", batch.waited_s)  # foreground: the sampling; background: the wait for it
        self._record("tool_calls", sum(r.timings.get("tool_s", 0.0) for r in batch.rollouts))
        self.last = batch
        return batch

    def prefetch(self, prompts: list, step: int) -> None:
        """``max_staleness: 1``: push the weights of ``step`` (between two generations), then sample the batch of
        step ``step + 1`` in the background with them while this step trains."""
        self._cancel()  # a job nobody took (an interrupted step) is stale
        self.push(step)
        job = _Job(for_step=step + 1, prompts=prompts, version=step)
        coroutine = self._arun(prompts, job.for_step)

        async def timed():
            start = time.perf_counter()
            try:
                return await coroutine
            finally:
                job.seconds = time.perf_counter() - start

        job.task, job.future = self._loop.submit(timed)
        self._job = job

    def push(self, step: int) -> None:
        """Give the engine the weights of global step ``step`` unless it holds them. Collective: every process
        joins (the gathers of sharded weights), rank 0 sends, and all wait, so none samples from weights being
        replaced; never while a background job samples."""
        if self.version == step:
            return
        if self.overlaps:  # never replace weights under a running generation: wait for this process's job,
            if self._job is not None:  # then for every process's
                concurrent.futures.wait([self._job.future])
            self._world.wait_for_everyone()
        start = time.perf_counter()
        self.engine.push_weights(self._policy())
        self._world.wait_for_everyone()
        self._record("weight_push", time.perf_counter() - start)
        self.version = step

    # -- reading the next batch ahead (max_staleness: 1) ----------------------------------------------------
    def read_batches(self, fetch, epoch_iterator, num_batches, device, *, micro_step: int, state):
        """Trainer's ``get_batch_samples`` through ``fetch``; with overlap, also read the next update's first
        batch when that update starts a generation (handed back at the next call), for ``start_read_ahead``."""
        if not self.overlaps:
            return fetch(epoch_iterator, num_batches, device)
        batches, num_items = fetch(self._peek.read(epoch_iterator), num_batches, device)
        self._read_ahead = None
        next_generates = (micro_step + len(batches)) % self._generate_every == 0
        if next_generates and state.global_step + 1 < state.max_steps:
            item = self._peek.peek(epoch_iterator)
            if item is not None:
                self._read_ahead = [as_conversation(copy.deepcopy(row["prompt"])) for row in item]
        return batches, num_items

    def start_read_ahead(self, step: int) -> None:
        """Prefetch the batch ``read_batches`` read ahead, if any (called once this step's batch is sampled)."""
        prompts, self._read_ahead = self._read_ahead, None
        if prompts is not None:
            self.prefetch(prompts, step)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def end_run(self) -> None:
        """After ``train()``: nothing sampled for this run outlives it, nor its thread; a later run (a resume)
        pushes before its first rollout."""
        self._cancel()
        self._loop.close()
        self.version, self._read_ahead, self._peek = None, None, NextBatchPeek()

    def close(self) -> None:
        """``end_run``, then stop the engine and the server this sampler started (also done at exit)."""
        self.end_run()
        close_engine = getattr(self.engine, "close", None)
        if callable(close_engine):
            close_engine()
        release, self._release = self._release, None
        if release is not None:
            release()

    # -- internals ------------------------------------------------------------------------------------------
    def _take(self, prompts: list, step: int) -> SampledBatch | None:
        job, self._job = self._job, None
        if job.for_step != step or job.prompts != prompts:
            self._cancel_job(job)
            return None
        start = time.perf_counter()
        try:
            rollouts = job.future.result()
        except Exception as error:  # the job's failure; Ctrl-C / SIGTERM while waiting go up as they are
            raise RuntimeError(
                f"the background generation (max_staleness=1, weights of step {job.version}) failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        return SampledBatch(rollouts, job.version, time.perf_counter() - start, job.seconds)

    def _cancel(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            self._cancel_job(job)

    def _cancel_job(self, job: _Job) -> None:
        """Returns once the task unwound (conversations cancelled, tool pool shut down), not merely when asked."""
        self._loop.cancel(job.task)
        with contextlib.suppress(Exception):
            job.future.result(CLOSE_TIMEOUT_S)

    def _run_now(self, prompts: list, step: int, settings: dict | None = None) -> list:
        return run_to_completion(self._arun(prompts, step, settings))

    def _arun(self, prompts: list, step: int, settings: dict | None = None):
        """The rollouts of the batch trained at ``step``: its seed differs per step and per process."""
        config = rollout_config(self._args, step, self._world.process_index, system=self.system)
        config = dataclasses.replace(config, **settings) if settings else config
        return arun_rollouts(self.engine, prompts, tokenizer=self._tokenizer, tools=self.tools, config=config)
