"""The CPU demo's task, generated: the last three digits of a product, which only the python tool gets right.

Every problem states one Python expression verbatim (``482 * 771 * 510 % 1000``, the last three digits of the
product of three 3-digit numbers); its answer is that exact value, which the demo model cannot work out in its
head (a guess is right one time in a thousand) but one ``print(expression)`` in the sandbox does. The rows use
the same prompt format and ``answer`` column as the shipped ReTool samples (``formats.retool_row``), so
``trl_gptoss.rewards.retool_reward`` scores them unchanged; the task is the ``arithmetic`` row of ``TASKS``.

Generation is a pure function of the seed (``random.Random(seed)``), so a run is reproducible and the
training and evaluation splits never overlap (different seeds draw from a space of ~10^9 expressions).
Each operand and the answer are one o200k token (digit runs split in chunks of up to three), and every
problem has the same token layout. Why this shape: docs/quickstart.md ("The demo's design").
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trl_gptoss.data.formats import retool_row

if TYPE_CHECKING:  # `datasets` takes ~1 s to import: only building the Dataset imports it
    from datasets import Dataset

# ``{expr}`` is repeated verbatim in the question so the answer is one copy of the expression into the tool
# away. The questions differ only BEFORE the expression, so the distance from each operand in the prompt to its
# copy in the call is the same in every problem.
QUESTIONS = (
    "Compute {expr} (the last three digits of the product).",
    "Calculate {expr} (the last three digits of the product).",
    "What is {expr} (the last three digits of the product)?",
    "Work out {expr} (the last three digits of the product).",
)
EXPRESSION = "{a} * {b} * {c} % 1000"
OPERAND_RANGE = (100, 999)  # one o200k token each


@dataclass(frozen=True)
class ArithmeticProblem:
    """One problem: the question text, the Python expression it asks for, and the exact integer value."""

    question: str
    expression: str
    answer: int


def make_problem(rng: random.Random) -> ArithmeticProblem:
    """Draw one problem. The value is computed here with Python ints (exact), never by the model."""
    question_template = rng.choice(QUESTIONS)
    expression = EXPRESSION.format(**{name: rng.randint(*OPERAND_RANGE) for name in "abc"})
    answer = eval(expression, {"__builtins__": {}})  # our own template of digits and * %: safe to evaluate
    return ArithmeticProblem(question_template.format(expr=expression), expression, answer)


def make_problems(n: int, seed: int) -> list[ArithmeticProblem]:
    """``n`` problems drawn from ``random.Random(seed)``."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive number of problems, got {n!r}")
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]


def arithmetic_dataset(n: int, seed: int) -> Dataset:
    """``Dataset`` with TRL's conversational ``prompt`` column and the ReTool ``answer`` column."""
    from datasets import Dataset

    return Dataset.from_list([retool_row(p.question, str(p.answer)) for p in make_problems(n, seed)])
