"""Where a conversion writes: DST is checked before the first write, built under a temporary name, renamed last.

``check_destination(dst)`` refuses, before anything is written, a DST that is a file, a non-empty directory, a
dangling symlink, under a file, or under a directory this process cannot write; a symlink to an empty
directory is followed. ``staged_directory(dst)`` creates ``.<name>.partial-<random>`` beside DST (and the
missing parents), yields it, and on success fsyncs it and renames it to DST (replacing an empty DST
directory), so DST appears complete or not at all. On any error (a full disk included) it removes the
staging directory and the parents it created and raises ``CheckpointError`` saying so; an interrupt
(``KeyboardInterrupt``) cleans up the same way and propagates. Only a process killed outright can leave a
``.<name>.partial-*`` directory beside DST, never a DST that looks complete.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError

from trl_gptoss.checkpoint.safetensors_files import CheckpointError

PARTIAL_MARK = ".partial-"


def check_destination(dst: Path) -> Path:
    """The directory to create (DST, or the empty directory a DST symlink points to); refuses what cannot work."""
    dst = Path(os.path.abspath(dst))
    if dst.is_symlink():
        if not dst.exists():
            raise CheckpointError(f"DST {dst} is a dangling symlink (to {os.readlink(dst)}); pass a new directory")
        dst = dst.resolve()
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"DST {dst} is a file; pass a new or empty directory")
    if dst.is_dir() and any(dst.iterdir()):
        raise CheckpointError(f"DST {dst} is not empty; pass a new or empty directory (nothing is overwritten)")
    ancestor = dst.parent
    while not ancestor.exists() and not ancestor.is_symlink():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        what = "a dangling symlink" if ancestor.is_symlink() else "a file"
        raise CheckpointError(f"DST {dst} is under {ancestor}, which is {what}; pass a directory path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise CheckpointError(f"DST {dst}: cannot create it, {ancestor} is not writable by this user")
    return dst


def _make_parents(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; return the ones created, outermost first."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        path.mkdir()
    return list(reversed(missing))


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove(stage: Path | None, created: list[Path]) -> None:
    if stage is not None:
        shutil.rmtree(stage, ignore_errors=True)
    for path in reversed(created):
        with contextlib.suppress(OSError):
            path.rmdir()


@contextlib.contextmanager
def staged_directory(dst: Path) -> Iterator[Path]:
    """Yield an empty staging directory beside ``dst``; rename it to ``dst`` when the block succeeds."""
    created: list[Path] = []
    stage = None
    try:
        created = _make_parents(dst.parent)
        while stage is None:
            candidate = dst.parent / f".{dst.name}{PARTIAL_MARK}{secrets.token_hex(4)}"
            with contextlib.suppress(FileExistsError):
                candidate.mkdir()  # the mode follows the umask, as DST's would
                stage = candidate
        yield stage
        for path in stage.iterdir():
            _fsync(path)
        _fsync(stage)
        os.rename(stage, dst)  # atomic; replaces DST only when it is an empty directory
    except (OSError, SafetensorError) as exc:
        _remove(stage, created)
        message = f"writing {dst} failed: {exc}; what was written is removed, {dst} was not created"
        raise CheckpointError(message) from exc
    except BaseException:
        _remove(stage, created)
        raise
    with contextlib.suppress(OSError):  # DST is complete; this only makes its name durable sooner
        _fsync(dst.parent)
