"""A synthetic ReTool-style task whose answers need the python tool: exact arithmetic on 4-6 digit numbers.

Every problem states one integer expression verbatim (``48213 * 7719 + 5102``); its answer is the exact
value, which no small model can produce in its head but one ``print(expression)`` in the sandbox does. The
rows use the same prompt format and ``answer`` column as the shipped ReTool samples
(``trl_gptoss.data.formats.retool_row``), so ``trl_gptoss.rewards.retool_reward`` scores them unchanged.

Generation is a pure function of the seed (``random.Random(seed)``), so a run is reproducible and the
training and evaluation splits never overlap (different seeds draw from a space of ~10^25 expressions).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from datasets import Dataset

from trl_gptoss.data.formats import retool_row

# (question template, expression template); ``{expr}`` is repeated verbatim in the question so the answer is
# one copy of the expression into the tool away.
TEMPLATES = (
    ("Compute {expr}.", "{a} * {b}"),
    ("What is {expr}?", "{a} * {b} + {c}"),
    ("Find the value of {expr}.", "{a} + {b} + {c} + {d}"),
    ("Calculate {expr}.", "{a} * {b} - {c}"),
)
DIGITS = (4, 6)  # operand length range: products of such numbers are 7-12 digits long


@dataclass(frozen=True)
class ArithmeticProblem:
    """One problem: the question text, the Python expression it asks for, and the exact integer value."""

    question: str
    expression: str
    answer: int


def _operand(rng: random.Random) -> int:
    digits = rng.randint(*DIGITS)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def make_problem(rng: random.Random) -> ArithmeticProblem:
    """Draw one problem. The value is computed here with Python ints (exact), never by the model."""
    question_template, expression_template = TEMPLATES[rng.randrange(len(TEMPLATES))]
    expression = expression_template.format(**{name: _operand(rng) for name in "abcd"})
    answer = eval(expression, {"__builtins__": {}})  # our own template of digits and + - *: safe to evaluate
    return ArithmeticProblem(question_template.format(expr=expression), expression, answer)


def make_problems(n: int, seed: int) -> list[ArithmeticProblem]:
    """``n`` problems drawn from ``random.Random(seed)``."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive number of problems, got {n!r}")
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]


def arithmetic_dataset(n: int, seed: int) -> Dataset:
    """``Dataset`` with TRL's conversational ``prompt`` column and the ReTool ``answer`` column."""
    return Dataset.from_list([retool_row(p.question, str(p.answer)) for p in make_problems(n, seed)])
