"""Killed after step 2 and resumed from its checkpoint == the uninterrupted run (in-process engine, seeded)."""

import multiprocessing
import os

import pytest

from tests.trainer._workers import train_in_process_engine


def _entry(output_dir):
    os.environ["OMP_NUM_THREADS"] = "1"
    train_in_process_engine(output_dir, die_after_save_at=2)


@pytest.mark.slow
def test_kill_after_step_2_then_resume_equals_uninterrupted(tmp_path):
    uninterrupted = train_in_process_engine(str(tmp_path / "full"))
    killed = multiprocessing.get_context("spawn").Process(target=_entry, args=(str(tmp_path / "killed"),))
    killed.start()
    killed.join(600)
    assert killed.exitcode == 137, f"the run was not killed at its step-2 checkpoint (exit {killed.exitcode})"
    checkpoint = tmp_path / "killed" / "checkpoint-2"
    assert checkpoint.is_dir() and not (tmp_path / "killed" / "checkpoint-4").exists()
    resumed = train_in_process_engine(str(tmp_path / "killed"), resume_from=str(checkpoint))
    assert {3, 4} <= set(resumed)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5, abs=1e-7), (step, resumed, uninterrupted)
    assert uninterrupted[3] != uninterrupted[4]  # the steps differ: the comparison is not of constants
