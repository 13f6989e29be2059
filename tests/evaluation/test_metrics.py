"""pass@k, maj@k and mean@k against values computed by hand on fixed correctness matrices."""

import math
from fractions import Fraction
from itertools import combinations
from types import SimpleNamespace

import pytest

from trl_gptoss.evaluation import accuracy_metrics, majority_correct, pass_at_k, pass_ks


def _exact_pass_at_k(correct: list[bool], k: int) -> Fraction:
    """pass@k by enumeration: the share of k-subsets of the samples that hold a correct one."""
    subsets = list(combinations(range(len(correct)), k))
    return Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        pytest.param(4, 0, 1, 0.0, id="none-correct"),
        pytest.param(4, 4, 4, 1.0, id="all-correct-n-eq-k"),
        pytest.param(4, 1, 4, 1.0, id="one-correct-n-eq-k"),
        pytest.param(4, 1, 1, 0.25, id="pass1-is-c-over-n"),
        pytest.param(4, 1, 2, 0.5, id="1-C(3,2)/C(4,2)"),  # 1 - 3/6
        pytest.param(5, 2, 2, 0.7, id="1-C(3,2)/C(5,2)"),  # 1 - 3/10
        pytest.param(8, 3, 4, 1 - 5 / 70, id="1-C(5,4)/C(8,4)"),
        pytest.param(10, 0, 10, 0.0, id="none-correct-n-eq-k"),
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_enumeration_over_every_small_matrix():
    for n in range(1, 7):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_exact_pass_at_k(correct, k)), abs=1e-12)


def test_pass_at_k_stays_finite_where_binomials_overflow_floats():
    assert 0.0 < pass_at_k(2000, 3, 1024) <= 1.0 and math.isfinite(pass_at_k(2000, 3, 1024))


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5), (4.0, 1, 1), (4, 1, True * 1.5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_the_reported_ks_are_one_and_the_largest_power_of_two():
    assert [pass_ks(n) for n in (1, 2, 3, 4, 7, 8, 30)] == [[1], [1, 2], [1, 2], [1, 4], [1, 4], [1, 8], [1, 16]]


def _equal(a, b):
    return a == b


@pytest.mark.parametrize(
    "answers, correct, expected",
    [
        pytest.param(["4", "5", "4"], [True, False, True], True, id="majority-right"),
        pytest.param(["5", "4", "5"], [False, True, False], False, id="majority-wrong"),
        pytest.param(["5", "4"], [False, True], False, id="tie-goes-to-the-first-answer"),
        pytest.param([None, None, "4"], [False, False, True], True, id="no-answer-no-vote"),
        pytest.param([None, None], [False, False], False, id="nobody-answered"),
    ],
)
def test_majority_vote(answers, correct, expected):
    assert majority_correct(answers, correct, _equal) is expected


def test_accuracy_metrics_over_a_fixed_matrix():
    problems = [
        SimpleNamespace(correct=[True, True, False, False], answers=["1", "1", "2", "3"]),  # c=2, maj right
        SimpleNamespace(correct=[False, False, False, False], answers=["9", "9", None, "8"]),  # c=0
        SimpleNamespace(correct=[True, True, True, True], answers=["7", "7", "7", "7"]),  # c=4
    ]
    metrics = accuracy_metrics(problems, _equal)
    assert metrics["mean@4"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert metrics["pass@1"] == pytest.approx(metrics["mean@4"])
    assert metrics["pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert metrics["maj@4"] == pytest.approx(2 / 3)
    per_problem = [0.5, 0.0, 1.0]
    mean = sum(per_problem) / 3
    stderr = math.sqrt(sum((v - mean) ** 2 for v in per_problem) / 2 / 3)
    assert metrics["mean@4_stderr"] == pytest.approx(stderr)
    assert "maj@4" not in accuracy_metrics(problems, None)  # a task without answers has no maj@k
    one = accuracy_metrics(problems[:1], _equal)
    assert one["mean@4_stderr"] == 0.0


def test_problems_with_different_sample_counts_are_refused():
    problems = [
        SimpleNamespace(correct=[True], answers=[None]),
        SimpleNamespace(correct=[True, False], answers=[None] * 2),
    ]
    with pytest.raises(ValueError, match="same number of samples"):
        accuracy_metrics(problems, None)
