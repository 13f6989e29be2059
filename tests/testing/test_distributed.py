"""``launch`` says how each rank ended: its result, its traceback, or -- when it died without one (a signal
from outside, a segfault) -- its exit reason and the Python stacks ``faulthandler`` wrote. Before, a rank
killed by a signal surfaced as a ``FileNotFoundError`` on its missing result file (a CI run on record)."""

from __future__ import annotations

import pytest

from tests.testing import _launch_workers as workers
from trl_gptoss.testing.distributed import WorldFailed, launch


def test_results_come_back_in_rank_order(tmp_path):
    assert launch(workers.both_return, 2, tmp_path, timeout=120) == [{"rank": 0, "world": 2}, {"rank": 1, "world": 2}]


def test_a_segfault_names_the_signal_and_the_python_stack(tmp_path):
    with pytest.raises(WorldFailed) as failed:
        launch(workers.rank_one_segfaults, 2, tmp_path, timeout=120)
    message = str(failed.value)
    assert "rank1: killed by SIGSEGV, no result or traceback" in message
    assert "Segmentation fault" in message and "in rank_one_segfaults" in message
    assert "rank0" not in message and failed.value.signalled


def test_a_killed_rank_names_the_kill(tmp_path):
    with pytest.raises(WorldFailed, match="rank0: killed by SIGKILL, no result or traceback") as failed:
        launch(workers.rank_zero_is_killed, 2, tmp_path, timeout=120)
    assert failed.value.signalled


def test_a_rank_that_raises_reports_its_traceback_and_is_not_a_signal(tmp_path):
    with pytest.raises(WorldFailed, match=r"(?s)--- rank0\.err\n.*ValueError: rank zero's own error") as failed:
        launch(workers.rank_zero_raises, 2, tmp_path, timeout=120)
    assert not failed.value.signalled
