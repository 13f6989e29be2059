"""A synthetic ReTool-style task whose answers need the python tool: the exact product of three 3-digit numbers.

Every problem states one integer expression verbatim (``482 * 771 * 510``); its answer is the exact 7-9 digit
value, which no small model can produce in its head but one ``print(expression)`` in the sandbox does. The
rows use the same prompt format and ``answer`` column as the shipped ReTool samples
(``trl_gptoss.data.formats.retool_row``), so ``trl_gptoss.rewards.retool_reward`` scores them unchanged.

Generation is a pure function of the seed (``random.Random(seed)``), so a run is reproducible and the
training and evaluation splits never overlap (different seeds draw from a space of ~10^9 expressions).

Why this shape: o200k splits digit runs into chunks of up to three (``\\p{N}{1,3}``), so each operand is one
token, and every product of three 3-digit numbers has 7-9 digits, i.e. three chunks. Every problem has the
same token layout: writing the call is a copy of three tokens from a fixed distance back, and so is writing the
answer from the tool's output, circuits a two-layer model learns in a short warm-start. With 4-6 digit operands
the chunks (``482``, ``13``) shift with the operand lengths and the demo model never learned to copy them; with
``a * b + c`` mixed in (5-6 digit answers, two chunks) it copied the call but never the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from datasets import Dataset

from trl_gptoss.data.formats import retool_row

# ``{expr}`` is repeated verbatim in the question so the answer is one copy of the expression into the tool
# away. The questions differ only BEFORE the expression, so the distance from each operand in the prompt to its
# copy in the call is the same in every problem.
QUESTIONS = ("Compute {expr}.", "Calculate {expr}.", "Evaluate {expr}.", "Work out {expr}.")
EXPRESSION = "{a} * {b} * {c}"
OPERAND_RANGE = (100, 999)  # one o200k token each; products of three are 7-9 digits long


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
