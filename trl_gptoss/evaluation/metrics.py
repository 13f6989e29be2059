"""Held-out accuracy from a correctness matrix: mean@k, unbiased pass@k, maj@k, with standard errors.

Each problem has ``n`` samples, each correct or not; ``k <= n``:

- ``mean@n``: the share of correct samples, averaged over problems (verl's mean@N; the retrospective's mean@30).
- ``pass@k``: the probability that at least one of ``k`` samples drawn without replacement from the ``n`` is
  correct, estimated without bias from ``c`` correct ones as ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code", eq. 1), computed as a running product (no huge binomials).
- ``maj@n``: the answer most of the ``n`` samples give (final answers grouped by the task's answer comparison;
  samples without an answer do not vote; a tie goes to the answer given first) is correct.

Standard errors are over problems: ``std(per-problem values, ddof=1) / sqrt(problems)`` (0 for one problem).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct samples out of ``n``."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)) or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs integers 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_correct(answers: Sequence, correct: Sequence[bool], same: Callable[[object, object], bool]) -> bool:
    """maj@n of one problem: ``answers[i]`` (None: no answer, no vote) and ``correct[i]`` per sample; ``same``
    decides whether two answers are one vote."""
    groups: list[list[int]] = []  # sample indices per distinct answer, in order of first appearance
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        for group in groups:
            if same(answers[group[0]], answer):
                group.append(index)
                break
        else:
            groups.append([index])
    if not groups:
        return False
    winner = max(groups, key=len)  # max keeps the first of equal lengths: the answer given first
    return bool(correct[winner[0]])


def pass_ks(n: int) -> list[int]:
    """The k reported for ``n`` samples: 1 and the largest power of two <= n (once when they coincide)."""
    largest = 1 << (n.bit_length() - 1)
    return sorted({1, largest})


@dataclass(frozen=True)
class Estimate:
    """A mean over problems and its standard error."""

    mean: float
    stderr: float

    @classmethod
    def over(cls, values: Sequence[float]) -> Estimate:
        if not values:
            raise ValueError("no problems to average over")
        mean = sum(values) / len(values)
        if len(values) == 1:
            return cls(mean, 0.0)
        variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
        return cls(mean, math.sqrt(variance / len(values)))


def accuracy_metrics(problems: Sequence, same: Callable[[object, object], bool] | None) -> dict[str, float]:
    """``mean@n``, ``pass@k`` (k from ``pass_ks``), ``maj@n`` (when ``same`` is given: the task has final
    answers) and their standard errors over ``problems`` (each with ``correct: list[bool]`` and ``answers``).
    Every problem must have the same ``n``."""
    sizes = {len(p.correct) for p in problems}
    if len(sizes) != 1:
        raise ValueError(f"every problem needs the same number of samples, got {sorted(sizes)}")
    (n,) = sizes
    columns = {f"mean@{n}": [sum(p.correct) / n for p in problems]}
    for k in pass_ks(n):
        columns[f"pass@{k}"] = [pass_at_k(n, sum(p.correct), k) for p in problems]
    if same is not None:
        columns[f"maj@{n}"] = [float(majority_correct(p.answers, p.correct, same)) for p in problems]
    metrics = {}
    for name, values in columns.items():
        estimate = Estimate.over(values)
        metrics[name], metrics[f"{name}_stderr"] = estimate.mean, estimate.stderr
    return metrics
