"""Workers for ``test_distributed.py`` (importable by ``spawn``): ranks that end in each way ``launch`` reports."""

from __future__ import annotations

import ctypes
import os
import signal


def rank_one_segfaults(rank: int, world: int) -> int:
    if rank == 1:
        ctypes.string_at(0)
    return rank


def rank_zero_is_killed(rank: int, world: int) -> int:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def rank_zero_raises(rank: int, world: int) -> int:
    if rank == 0:
        raise ValueError("rank zero's own error")
    return rank


def both_return(rank: int, world: int) -> dict:
    return {"rank": rank, "world": world}
