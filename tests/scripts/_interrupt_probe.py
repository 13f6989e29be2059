"""What the Ctrl-C tests launch in place of ``examples/retool_grpo.py``: the same job, with one hook that holds the
run at a chosen moment until the test has sent its signal, so the signal lands in that moment every time.

``INTERRUPT_DIR``: where the hook writes ``reached`` (the moment, once the run is in it) and waits for ``sent``
(written by the test after the signal); ``sigint`` records this process's SIGINT disposition at start.
``INTERRUPT_AT``: one of ``MOMENTS`` -- each a call of the real run, held after checkpoint-1 is complete:

- ``generation``: a request to the rollout engine (the main thread runs the event loop);
- ``tool_call``: a tool call, on its worker thread (the main thread waits in the event loop);
- ``loss``: the trainer's loss of a micro-batch (main thread);
- ``push``: the weight push before a batch is sampled (main thread);
- ``save``: checkpoint-2's save, after the weights and before the optimizer state and ``trainer_state.json``;
- ``overlapped_generation``: with ``max_staleness: 1``, a background request, held until the main thread waits
  for that batch.

A hook on the main thread sleeps in short steps (the signal's exception is raised there); one on another thread
goes on once ``sent`` exists. Nothing else of the run is changed.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOMENTS = ("generation", "tool_call", "loss", "push", "save", "overlapped_generation")
HOLD_S = 120.0  # a hook lets the run go on after this: the test's exit bound then fails instead of a hang


class Moment:
    def __init__(self, directory: Path, name: str):
        self.directory, self.name, self.trainer = directory, name, None
        self._lock, self._taken = threading.Lock(), False

    def due(self, name: str, min_step: int = 1) -> bool:
        """Whether the run is now in the moment to hold (the first call of it from step ``min_step`` on)."""
        if name != self.name or self.trainer is None or self.trainer.state.global_step < min_step:
            return False
        with self._lock:
            taken, self._taken = self._taken, True
        return not taken

    def reached(self) -> None:
        part = self.directory / "reached.part"
        part.write_text(f"{self.name} {threading.current_thread().name}")
        part.rename(self.directory / "reached")

    def hold(self) -> None:
        """Until the test sent its signal (on the main thread, the signal's exception ends this sleep)."""
        self.reached()
        deadline = time.monotonic() + HOLD_S
        while not (self.directory / "sent").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if threading.current_thread() is threading.main_thread():
            while time.monotonic() < deadline:  # the signal's exception is due any moment now
                time.sleep(0.01)

    async def ahold(self, *, after=lambda: True) -> None:
        import asyncio

        deadline = time.monotonic() + HOLD_S
        while not after() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.reached()
        while not (self.directory / "sent").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


def _main_thread_waits_for_the_batch() -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == "_take":  # Sampler._take: waiting for the background batch
            return True
        frame = frame.f_back
    return False


def install(moment: Moment) -> None:
    from trl_gptoss.tools import ToolSet
    from trl_gptoss.trainer import GptOssGRPOTrainer

    train = GptOssGRPOTrainer.train

    def probed_train(trainer, *args, **kwargs):
        moment.trainer = trainer
        engine = trainer.sampler.engine
        generate, push_weights = engine.generate, engine.push_weights
        compute_loss, save_optimizer = trainer.compute_loss, trainer._save_optimizer_and_scheduler

        async def held_generate(request):
            if moment.due("generation"):
                await moment.ahold()
            elif moment.due("overlapped_generation"):
                await moment.ahold(after=_main_thread_waits_for_the_batch)
            return await generate(request)

        def held_push(model):
            if moment.due("push"):
                moment.hold()
            return push_weights(model)

        def held_loss(*args, **kwargs):
            if moment.due("loss"):
                moment.hold()
            return compute_loss(*args, **kwargs)

        def held_save(output_dir):
            if moment.due("save", min_step=2):
                moment.hold()
            return save_optimizer(output_dir)

        engine.generate, engine.push_weights = held_generate, held_push
        trainer.compute_loss, trainer._save_optimizer_and_scheduler = held_loss, held_save
        return train(trainer, *args, **kwargs)

    call = ToolSet.call

    def held_call(toolset, *args, **kwargs):
        if moment.due("tool_call"):
            moment.hold()
        return call(toolset, *args, **kwargs)

    GptOssGRPOTrainer.train, ToolSet.call = probed_train, held_call


def main(argv: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test dumps every thread's stack when stuck
    directory = Path(os.environ["INTERRUPT_DIR"])
    (directory / "sigint").write_text(repr(signal.getsignal(signal.SIGINT)))
    name = os.environ["INTERRUPT_AT"]
    assert name in MOMENTS, f"INTERRUPT_AT={name!r}; choose one of {MOMENTS}"
    spec = importlib.util.spec_from_file_location("retool_grpo", ROOT / "examples" / "retool_grpo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    install(Moment(directory, name))
    example.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
    from trl_gptoss.scripts.grpo import exit_launched_job

    exit_launched_job()  # as examples/retool_grpo.py's __main__ does
