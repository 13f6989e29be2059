"""ReTool and GSM8K rewards called exactly as TRL's GRPOTrainer calls them."""

import pytest

from trl_gptoss.rewards import gsm8k_answer, gsm8k_reward, retool_reward


def _as_trl(reward, completions, **columns):
    """The keyword set ``GRPOTrainer._calculate_rewards`` passes (trl 1.16)."""
    n = len(completions)
    return reward(
        prompts=[[{"role": "user", "content": "q"}]] * n,
        completions=completions,
        completion_ids=[[1, 2]] * n,
        trainer_state=None,
        log_extra=lambda *a: None,
        log_metric=lambda *a: None,
        **columns,
    )


RETOOL_TABLE = [
    ("The answer is \\boxed{1,024}.", "1024", 1.0),
    ("\\boxed{\\frac{7}{2}}", "3.5", 1.0),
    ("First \\boxed{3} then corrected: \\boxed{4}", "4", -1.0),  # every box must state the answer
    ("First \\boxed{4} then corrected: \\boxed{3}", "4", -1.0),
    ("The answer is 12 (no box)", "12", -1.0),
    ("\\boxed{12\\%}", "12", 1.0),
    ("\\boxed{-0.25}", "-\\frac{1}{4}", 1.0),
    ("\\boxed{x = 9}", "9", 1.0),
    ("\\boxed{8}", "9", -1.0),
]


def test_retool_reward_table():
    completions = [[{"role": "assistant", "content": c}] for c, _, _ in RETOOL_TABLE]
    rewards = _as_trl(retool_reward, completions, answer=[a for _, a, _ in RETOOL_TABLE])
    assert rewards == [r for _, _, r in RETOOL_TABLE]


def test_retool_reward_reads_a_boxed_solution_and_skips_missing_truth():
    rewards = _as_trl(retool_reward, ["\\boxed{6}", "\\boxed{6}"], solution=["2 * 3 = \\boxed{6}", None])
    assert rewards == [1.0, None]


GSM8K_TABLE = [
    ("She has 5 + 7 = 12 apples.\n#### 12", "5 + 7 = 12\n#### 12", 1.0),
    ("The total is $1,250.", "#### 1250", 0.0),  # unmarked: no last-number fallback in rewards
    ("So the answer is \\boxed{18}.", "#### 18", 1.0),
    ("It costs 3 dollars, so 4 cost 12 dollars... the final answer is 12", "#### 12", 1.0),
    ("3 + 4 = 7, then 7 * 2 = 14", "#### 15", 0.0),
    ("no idea", "#### 3", 0.0),
    ("#### -4", "#### -4", 1.0),
    # prose markers are every one an answer, as #### markers are: all must agree
    ("The answer is 5. The answer is 6.", "#### 6", 0.0),
    ("The answer is 5.\nThe answer is 6.", "#### 5", 0.0),
    ("#### 5\n#### 6", "#### 6", 0.0),
    ("The answer is 6.\nChecking: 2 * 3 = 6, so the answer is 6.", "#### 6", 1.0),
    ("The answer is 6. Or 7, so the answer is 6.", "#### 6", 0.0),  # a value runs to its line's end
    ("Answer: 6\nFinal answer is 6", "#### 6", 1.0),
]


def test_gsm8k_reward_table():
    completions = [c for c, _, _ in GSM8K_TABLE]
    assert _as_trl(gsm8k_reward, completions, answer=[a for _, a, _ in GSM8K_TABLE]) == [r for _, _, r in GSM8K_TABLE]
    assert gsm8k_answer("reasoning\n#### 1,000") == "1,000"


def test_misaligned_or_missing_columns_raise():
    with pytest.raises(ValueError, match="must align"):
        retool_reward(["\\boxed{1}"], answer=["1", "2"])
    with pytest.raises(ValueError, match="'answer'"):
        gsm8k_reward(["1"])
