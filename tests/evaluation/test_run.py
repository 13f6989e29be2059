"""``evaluate_rows`` + ``summarize`` over real rollouts (the rollout loop with a scripted engine), real rewards."""

import re

import pytest

from tests.rollout.loop_helpers import final, scripted, user
from trl_gptoss.evaluation import Grader, evaluate_rows, reward_grader, summarize, task_graders
from trl_gptoss.rollout.loop import run_rollouts
from trl_gptoss.testing import harmony_tokenizer

ROWS = [
    {"prompt": user("What is 2 + 2?"), "answer": "4", "task": "retool"},  # answered right
    {"prompt": user("What is 3 + 5?"), "answer": "8", "task": "retool"},  # answered wrong
    {"prompt": user("What is 6 * 7?"), "answer": "#### 42", "task": "gsm8k"},  # right, with a comma-free answer
]
SCRIPTS = [r"The answer is \boxed{4}.", r"\boxed{7}", "The answer is 42."]


@pytest.fixture(scope="module")
def tokenizer():
    return harmony_tokenizer()


def _sampler(tokenizer):
    engine = scripted(tokenizer, [(row["prompt"], [final(text)]) for row, text in zip(ROWS, SCRIPTS)])
    calls = []

    def sample(prompts):
        calls.append(len(prompts))
        return run_rollouts(engine, prompts, tokenizer=tokenizer)

    return sample, calls


def test_every_problem_is_sampled_k_times_in_one_batch_and_graded_by_its_task(tokenizer):
    sample, calls = _sampler(tokenizer)
    results = evaluate_rows(sample, ROWS, task_graders(), k=3, default_task="retool")
    assert calls == [9]  # 3 problems x k=3, all handed over at once
    assert [r.correct for r in results] == [[True] * 3, [False] * 3, [True] * 3]
    assert [r.answers[0] for r in results] == [("4",), ("7",), ("42",)]
    metrics = summarize(results, task_graders(), seconds=1.5)
    assert metrics["retool/mean@3"] == 0.5 and metrics["gsm8k/mean@3"] == 1.0
    assert metrics["mean@3"] == pytest.approx(2 / 3) and metrics["pass@2"] == pytest.approx(2 / 3)
    assert metrics["retool/maj@3"] == 0.5 and metrics["reward"] == pytest.approx((3 - 3 + 3) / 9)
    assert metrics["maj@3"] == pytest.approx(2 / 3)  # both tasks compare answers by one rule: an overall vote
    assert metrics["problems"] == 3 and metrics["samples"] == 9 and metrics["truncated"] == 0.0
    assert metrics["tool_calls"] == 0.0 and metrics["turns"] == 1.0 and metrics["seconds"] == 1.5
    assert results[2].to_dict()["final_answers"] == ["The answer is 42."] * 3


def test_a_reward_that_raises_makes_its_sample_wrong_and_is_reported(tokenizer):
    sample, _ = _sampler(tokenizer)

    def flaky(completions, answer, **kwargs):
        if answer[0] == "8":
            raise ZeroDivisionError("the checker divided by zero")
        return [1.0]

    graders = {"mine": Grader("mine", flaky)}
    rows = [{k: v for k, v in row.items() if k != "task"} for row in ROWS]
    results = evaluate_rows(sample, rows, graders, k=2, default_task="mine")
    assert [r.correct for r in results] == [[True, True], [False, False], [True, True]]
    assert results[1].reward_errors == ["ZeroDivisionError: the checker divided by zero"] * 2
    metrics = summarize(results, graders)
    assert metrics["reward_errors"] == 2.0 and metrics["mean@2"] == pytest.approx(2 / 3)


def test_a_row_naming_an_unknown_task_is_refused(tokenizer):
    sample, _ = _sampler(tokenizer)
    with pytest.raises(ValueError, match=r"row 0 names task 'chess'"):
        evaluate_rows(sample, [{**ROWS[0], "task": "chess"}], task_graders(), k=1, default_task="retool")


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        (float("inf"), r"reward function 'hostile' returned inf for completion 0; rewards must be finite"),
        (float("nan"), r"reward function 'hostile' returned nan for completion 0; rewards must be finite"),
        ("1", r"reward function 'hostile' returned str '1' for completion 0; return a number"),
        ({"score": 1}, r"reward function 'hostile' returned dict .* return a number"),
        (object(), r"reward function 'hostile' returned object for completion 0, which is not a number"),
        (1e12, r"reward function 'hostile' returned 1000000000000.0 .* at most 1e\+09 in magnitude"),
    ],
    ids=["inf", "nan", "string", "dict", "object", "huge"],
)
def test_a_reward_training_refuses_makes_its_sample_wrong_with_the_functions_name(tokenizer, value, refusal):
    """One grading rule: what training's reward checks refuse (naming the function) is a wrong sample with the
    refusal in ``reward_errors``, never a right one, and never a crash of the evaluation."""
    sample, _ = _sampler(tokenizer)

    def hostile(completions, **kwargs):
        return [value]

    graders = {"mine": Grader("mine", hostile)}
    results = evaluate_rows(sample, [{**ROWS[0], "task": "mine"}], graders, k=2, default_task="mine")
    assert results[0].correct == [False, False] and results[0].rewards == [None, None]
    assert all(re.search(refusal, error) for error in results[0].reward_errors), results[0].reward_errors
    metrics = summarize(results, graders)
    assert metrics["reward_errors"] == 2.0 and metrics["mean@2"] == 0.0 and metrics["pass@2"] == 0.0


def test_a_runs_own_rewards_are_checked_one_by_one_naming_the_refused_function(tokenizer):
    sample, _ = _sampler(tokenizer)

    def fine(completions, **kwargs):
        return [1.0]

    def infinite(completions, **kwargs):
        return [float("inf")]

    graders = {"rewards": reward_grader("rewards", [fine, infinite], [1.0, 0.0])}
    (result,) = evaluate_rows(sample, [{**ROWS[0], "task": "rewards"}], graders, k=1, default_task="rewards")
    assert result.correct == [False]  # a zero weight does not hide a refused value (inf * 0 would be nan)
    assert "reward function 'infinite' returned inf" in result.reward_errors[0]


def test_each_problem_is_reported_as_soon_as_its_k_samples_are_graded(tokenizer):
    """``on_problem`` through ``trl-gptoss eval``'s sampler (the real loop, conversations ending one by one): every
    problem once, with all k samples graded, before the batch returns; the results are the ones returned."""
    from trl_gptoss.rollout.config import RolloutConfig
    from trl_gptoss.scripts.eval import rollout_sampler

    engine = scripted(tokenizer, [(row["prompt"], [final(text)]) for row, text in zip(ROWS, SCRIPTS)])
    sample = rollout_sampler(engine, tokenizer, (), RolloutConfig(max_turns=2, max_completion_tokens=64))
    reported = []
    results = evaluate_rows(sample, ROWS, task_graders(), k=3, default_task="retool", on_problem=reported.append)
    assert sorted(r.problem for r in reported) == [0, 1, 2] and all(len(r.correct) == 3 for r in reported)
    assert all(any(r is returned for r in reported) for returned in results)
    assert [r.correct for r in results] == [[True] * 3, [False] * 3, [True] * 3]


def test_a_row_naming_an_unknown_task_is_refused_before_anything_is_sampled(tokenizer):
    sample, calls = _sampler(tokenizer)
    with pytest.raises(ValueError, match=r"row 1 names task 'chess'"):
        evaluate_rows(sample, [ROWS[0], {**ROWS[1], "task": "chess"}], task_graders(), k=1, default_task="retool")
    assert calls == []
