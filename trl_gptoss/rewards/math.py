"""Math rewards with TRL's reward-function signature: ``f(completions, **dataset_columns) -> list[float]``.

TRL calls ``reward(prompts=..., completions=..., completion_ids=..., **columns)`` where each dataset
column (e.g. ``answer``) arrives as a list aligned with ``completions``. ``None`` marks a completion the
function cannot score (TRL turns it into NaN and ignores it in the mean over reward functions).
"""

from __future__ import annotations

from trl_gptoss.rewards.answers import all_answers_match, boxed_answers, completion_text, last_boxed, marked_answers

RETOOL_CORRECT, RETOOL_WRONG = 1.0, -1.0


def _truths(answer, solution, n: int, name: str) -> list:
    column = answer if answer is not None else solution
    if column is None:
        raise ValueError(f"{name} needs an 'answer' (or 'solution') dataset column with the ground truth.")
    if len(column) != n:
        raise ValueError(f"{name}: {n} completions but {len(column)} ground-truth answers; they must align.")
    return list(column)


def retool_reward(completions, answer=None, solution=None, **kwargs) -> list[float | None]:
    """ReTool outcome reward: ``+1`` when the final answer equals the ground truth, else ``-1``.

    The final answer is boxed (ReTool's format): every outermost ``\\boxed{}`` of the completion must state
    the truth (``\\boxed{3} or \\boxed{4}`` is a list of guesses); without one, the model gets ``-1`` (no
    partial credit for a number buried in the reasoning). ``answer`` holds the ground
    truth; ``solution`` may instead hold a worked solution ending in ``\\boxed{}``. Rows whose ground truth
    is ``None`` score ``None``.
    """
    truths = _truths(answer, solution, len(completions), "retool_reward")
    rewards: list[float | None] = []
    for completion, truth in zip(completions, truths):
        if truth is None:
            rewards.append(None)
            continue
        truth = str(truth)
        truth = last_boxed(truth) or truth
        predicted = boxed_answers(completion_text(completion)) or []
        rewards.append(RETOOL_CORRECT if all_answers_match(predicted, truth) else RETOOL_WRONG)
    return rewards


def gsm8k_answer(answer_field: str) -> str:
    """The number after ``####`` in a GSM8K ``answer`` field (the whole field when it has no marker)."""
    marker = answer_field.rfind("####")
    return answer_field[marker + 4 :].strip() if marker >= 0 else answer_field.strip()


def gsm8k_reward(completions, answer=None, **kwargs) -> list[float | None]:
    """GSM8K accuracy: ``1.0`` when the completion's final answer equals the ``#### x`` ground truth.

    The completion's answers are its outermost ``\\boxed{}``, else the values after each ``####``, else
    the value after its last "the answer is" / "Answer:"; every one must equal the truth. An unmarked
    number earns nothing: a "last number in the text" fallback would pay a completion that lists guesses
    (see ``answers.py`` for the policy).
    """
    truths = _truths(answer, None, len(completions), "gsm8k_reward")
    rewards: list[float | None] = []
    for completion, truth in zip(completions, truths):
        if truth is None:
            rewards.append(None)
            continue
        predicted = marked_answers(completion_text(completion))
        rewards.append(1.0 if all_answers_match(predicted, gsm8k_answer(str(truth))) else 0.0)
    return rewards
