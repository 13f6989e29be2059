"""Task rewards with TRL's reward-function signature ``f(completions, **dataset_columns) -> list[float]``.

- ``retool_reward``: ReTool outcome reward (+1 / -1), numeric-aware ``\\boxed{}`` answer vs ground truth.
- ``gsm8k_reward``: GSM8K accuracy (1 / 0) against the ``#### x`` answer.
- ``verifyif_reward`` / ``verifyif_strict_reward``: instruction following with verifiable constraints.
"""

from trl_gptoss.rewards.answers import answers_match, completion_text, extract_final_answer, last_boxed
from trl_gptoss.rewards.constraints import CHECKERS, check_constraint, validate_constraint
from trl_gptoss.rewards.math import gsm8k_answer, gsm8k_reward, retool_reward
from trl_gptoss.rewards.numbers import MAX_ANSWER_CHARS, parse_number
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
    "answers_match",
    "check_constraint",
    "completion_text",
    "extract_final_answer",
    "gsm8k_answer",
    "gsm8k_reward",
    "last_boxed",
    "parse_constraints",
    "parse_number",
    "retool_reward",
    "score_constraints",
    "validate_constraint",
    "verifyif_reward",
    "verifyif_strict_reward",
]
