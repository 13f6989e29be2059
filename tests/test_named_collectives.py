"""``named_collectives``: every rank's object in rank order (``all_gather_object``), one rank's object on every
rank (``broadcast_object``, what the weight push shares its plan with), and a deadline that ends a mismatched
collective with an error naming it (instead of blocking until the process group's timeout)."""

import pytest

from tests.trainer._eval_workers import broadcast_rank, gather_rank
from trl_gptoss.testing.distributed import launch

pytestmark = pytest.mark.distributed


def test_every_rank_gets_every_ranks_object_in_rank_order(tmp_path):
    results = launch(gather_rank, 3, tmp_path, None, timeout=120)
    expected = [{"rank": r, "rows": [r] * (r + 1)} for r in range(3)]  # payloads of different sizes
    assert [r["gathered"] for r in results] == [expected] * 3


def test_a_rank_in_another_collective_ends_the_gather_with_an_error_naming_it(tmp_path):
    rank0, rank1 = launch(gather_rank, 2, tmp_path, 1, timeout=120)
    assert rank0["error"] == "CollectiveTimeout"
    assert "rank 0 of 2: the collective 'test gather (sizes)' did not complete within 3 s" in rank0["message"]
    assert "error" in rank1  # its barrier never paired either: no rank blocks past its deadline


def test_one_ranks_object_reaches_every_rank(tmp_path):
    results = launch(broadcast_rank, 3, tmp_path, timeout=120)
    assert [r["got"] for r in results] == [{"plan": ["reload", "direct"], "from": 1}] * 3
