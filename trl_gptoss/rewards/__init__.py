"""Task rewards with TRL's reward-function signature ``f(completions, **dataset_columns) -> list[float]``.

- ``retool_reward``: ReTool outcome reward (+1 / -1), numeric-aware ``\\boxed{}`` answer vs ground truth.
- ``answers_match``: exact numbers (precision as written), structural comparison of symbolic answers.
- ``gsm8k_reward``: GSM8K accuracy (1 / 0) against the ``#### x`` answer.
- ``verifyif_reward`` / ``verifyif_strict_reward``: instruction following with verifiable constraints.
"""

from trl_gptoss.rewards.answers import (
    all_answers_match,
    answers_match,
    boxed_answers,
    completion_text,
    extract_final_answer,
    last_boxed,
    marked_answers,
)
from trl_gptoss.rewards.constraints import CHECKERS, check_constraint, validate_constraint
from trl_gptoss.rewards.math import gsm8k_answer, gsm8k_reward, retool_reward
from trl_gptoss.rewards.numbers import MAX_ANSWER_CHARS, WrittenNumber, parse_number, read_number
from trl_gptoss.rewards.structure import answer_structure, answer_tokens, same_structure
from trl_gptoss.rewards.verifyif import (
    ConstraintScores,
    parse_constraints,
    score_constraints,
    verifyif_reward,
    verifyif_strict_reward,
)

__all__ = [
    "CHECKERS",
    "MAX_ANSWER_CHARS",
    "ConstraintScores",
    "WrittenNumber",
    "all_answers_match",
    "answer_structure",
    "answer_tokens",
    "answers_match",
    "boxed_answers",
    "check_constraint",
    "completion_text",
    "extract_final_answer",
    "gsm8k_answer",
    "gsm8k_reward",
    "last_boxed",
    "marked_answers",
    "parse_constraints",
    "parse_number",
    "read_number",
    "retool_reward",
    "same_structure",
    "score_constraints",
    "validate_constraint",
    "verifyif_reward",
    "verifyif_strict_reward",
]
