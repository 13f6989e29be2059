"""Stopping and resuming a run: the same rules for the GRPO job and for ``GptOssGRPOTrainer`` used as a library.

- SIGTERM (a scheduler's preemption, ``kill``) raises ``Terminated``, a ``KeyboardInterrupt``, in the main thread,
  so the run stops as on Ctrl-C: ``finally`` blocks run and the trainer's rollout server is stopped, instead of
  the process dying where it stands. A second SIGTERM is ignored while the first unwinds. The trainer installs it
  for ``train()`` only where SIGTERM still has its default action (the job installs it for its whole run; an
  application's own handler is kept) and puts the default back when ``train()`` returns; after a ``train()``
  that ended by an exception (no hook runs then) its handler gives SIGTERM the default action again.
- A checkpoint cut off during its save is never resumed from. The Trainer writes ``checkpoint-N`` in place and
  ``trainer_state.json`` last, so a stop during a save leaves a partial folder that ``resume_from_checkpoint=True``
  (the job's ``latest``) would pick as the newest and fail to load. When a trainer is built, the main process
  renames each ``checkpoint-N`` of ``output_dir`` that ``checkpoint_problem`` finds fault with to
  ``incomplete-checkpoint-N`` (a warning names the file at fault): ``latest`` then finds the newest whole one, a
  path given explicitly no longer loads, and the Trainer's ``save_total_limit`` rotation (which reads any
  ``checkpoint-<digits>...`` name as that step) can neither count it nor delete a whole checkpoint in its place.
  Build a trainer on an ``output_dir`` only when no other run is saving into it.
- A resumed state past ``max_steps`` would train nothing and end as a success: refused at train begin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import struct
import threading
import zipfile
from pathlib import Path

from transformers import TrainerCallback, TrainerState

from trl_gptoss.trainer.fields import shown

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME: written last, after weights, optimizer, RNG
# torch.save files a Trainer checkpoint holds: each is a zip archive whose directory is written at its very end.
TORCH_FILES = ("rng_state*.pth", "optimizer.pt", "scheduler.pt", "scaler.pt")
_CHECKED_WHOLE = 1 << 20  # torch files up to this size (RNG states) have every member's CRC checked too
_STATE_FIELDS = {f.name for f in dataclasses.fields(TrainerState)}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so the run stops as on Ctrl-C (``finally`` blocks run)."""


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM while the first unwinds is ignored
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside, SIGTERM raises ``Terminated`` in the main thread (once). Elsewhere than the main thread,
    nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def checkpoint_problem(path) -> str | None:
    """Why the checkpoint folder ``path`` cannot be resumed from, naming the file at fault; None when it is whole.

    ``trainer_state.json`` must parse into the fields of transformers' ``TrainerState`` with ``global_step`` a
    non-negative integer and ``log_history`` a list of records; the torch files (RNG states, optimizer, scheduler,
    scaler) must be whole zip archives and every ``*.safetensors`` file as long as its header says. Only headers
    and zip directories are read, so a checkpoint of any size is judged in milliseconds.
    """
    path = Path(path)
    state_file = path / STATE_FILE
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{state_file} is missing (the Trainer writes it last: the save was cut off)"
    except (OSError, UnicodeDecodeError) as exc:
        return f"{state_file} cannot be read ({exc})"
    except (ValueError, RecursionError):
        return f"{state_file} is not valid JSON (cut off while it was written?)"
    if not isinstance(state, dict):
        return f"{state_file} holds a {type(state).__name__}, not the Trainer's state (a mapping)"
    if unknown := sorted(set(state) - _STATE_FIELDS):
        return f"{state_file} has fields transformers' TrainerState does not know: {shown(unknown)}"
    step = state.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"{state_file}: global_step must be a non-negative integer, got {shown(step)}"
    history = state.get("log_history", [])
    if not isinstance(history, list) or not all(isinstance(record, dict) for record in history):
        return f"{state_file}: log_history must be a list of records (mappings), got {shown(history)}"
    files = [file for pattern in TORCH_FILES for file in sorted(path.glob(pattern))]
    problems = (_torch_file_problem(file) for file in files)
    safetensors = (_safetensors_problem(file) for file in sorted(path.glob("*.safetensors")))
    return next((problem for problem in (*problems, *safetensors) if problem), None)


def _torch_file_problem(file: Path) -> str | None:
    try:
        with zipfile.ZipFile(file) as archive:
            broken = archive.testzip() if file.stat().st_size <= _CHECKED_WHOLE else None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        return f"{file} is truncated or not a torch.save archive ({exc})"
    return f"{file} is corrupt (member {broken} fails its CRC check)" if broken else None


def _safetensors_problem(file: Path) -> str | None:
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                raise ValueError(f"a {header_len}-byte header in {size} bytes")
            header = json.loads(f.read(header_len))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (struct.error, ValueError, OSError, KeyError, TypeError, IndexError, AttributeError) as exc:
        return f"{file} has no readable safetensors header ({exc})"
    needed = 8 + header_len + max(ends, default=0)
    return f"{file} is truncated ({size} of {needed} bytes)" if size < needed else None


def is_complete_checkpoint(path) -> bool:
    """``checkpoint_problem`` finds nothing at fault."""
    return checkpoint_problem(path) is None


def beyond_max_steps(global_step: int, max_steps: int) -> str | None:
    """A message when a run resumed at ``global_step`` would train nothing (``max_steps`` > 0 below it)."""
    if max_steps > 0 and global_step > max_steps:
        return (
            f"the checkpoint is at global_step={global_step}, beyond max_steps={max_steps}: resuming would train "
            "nothing and end as a success; raise max_steps, or resume from an earlier checkpoint"
        )
    return None


def resume_problem(path, max_steps: int) -> str | None:
    """``checkpoint_problem``, or a ``global_step`` past ``max_steps``."""
    if problem := checkpoint_problem(path):
        return problem
    step = json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))["global_step"]
    return beyond_max_steps(step, max_steps)


def set_aside_incomplete_checkpoints(output_dir) -> list[Path]:
    """Rename each ``checkpoint-N`` folder of ``output_dir`` that ``checkpoint_problem`` faults to
    ``incomplete-checkpoint-N`` (a warning names why); returns the new paths. A stale ``incomplete-checkpoint-N``
    from an earlier interrupted save of the same step is replaced."""
    moved = []
    for path in sorted(Path(output_dir).glob("checkpoint-*")):
        if not (re.fullmatch(r"checkpoint-\d+", path.name) and path.is_dir()):
            continue
        if (problem := checkpoint_problem(path)) is None:
            continue
        target = path.with_name(f"incomplete-{path.name}")
        if target.exists():  # an earlier interrupted save of the same step: no more use than this one
            shutil.rmtree(target)
        path.rename(target)
        logger.warning("%s cannot be resumed from (%s); set aside as %s", path, problem, target.name)
        moved.append(target)
    return moved


class StopAndResume(TrainerCallback):
    """SIGTERM as ``Terminated`` while ``train()`` runs, a resumed state checked before the first step, and --
    when built, on the main process -- the partial checkpoints of ``args.output_dir`` set aside."""

    def __init__(self, args):
        with args.main_process_first(desc="set incomplete checkpoints aside"):
            if args.should_save and Path(args.output_dir).is_dir():
                set_aside_incomplete_checkpoints(args.output_dir)
        self._fired = False

    def on_train_begin(self, args, state, control, **kwargs):
        if problem := beyond_max_steps(state.global_step, state.max_steps):
            raise ValueError(problem)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there
        current = signal.getsignal(signal.SIGTERM)
        if current == signal.SIG_DFL or isinstance(getattr(current, "__self__", None), StopAndResume):
            self._fired = False  # (a trainer's handler that outlived its train(): replaced)
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def on_train_end(self, args, state, control, **kwargs):
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _on_sigterm(self, signum, frame):
        """``Terminated`` inside ``train()``; a second SIGTERM while the first unwinds is ignored. Outside it (this
        handler outlived a ``train()`` that ended by an exception: ``on_train_end`` never ran) the default action:
        the process ends."""
        if not _inside_train(frame):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if not self._fired:
            self._fired = True
            raise Terminated()


def _inside_train(frame) -> bool:
    """Whether ``frame`` (the main thread's, where the signal landed) runs inside transformers' ``Trainer.train``."""
    from transformers import Trainer

    code = Trainer.train.__code__
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
