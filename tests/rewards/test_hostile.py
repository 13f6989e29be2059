"""Rewards are total: any completion gives a float in bounded time; the cases that crashed, stalled or were
scored wrongly before stay fixed; a property test fuzzes adversarial completions.

The time check here is a stall detector (super-linear code takes seconds to minutes on these inputs), not
the speed target: ``benchmarks/bench_rewards.py`` measures that (<= 50 ms per 100 kB completion).
"""

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_gptoss.rewards import (
    MAX_ANSWER_CHARS,
    answers_match,
    extract_final_answer,
    gsm8k_reward,
    last_boxed,
    parse_number,
    retool_reward,
    verifyif_reward,
    verifyif_strict_reward,
)
from trl_gptoss.testing.hostile_completions import ALL_CONSTRAINTS, CRASHES_AND_STALLS, FALSE_POSITIVES

# CPU seconds, not wall: the suite shares 2 cores with vLLM servers and gloo workers, and a stall is work
# the reward does, not time it waits for a core.
STALL_BUDGET_S = 1.0
TRUTHS = ["33", "1/3", "\\frac{\\pi}{2}", "1e5", "-0.25", "1170"]


def _score_everything(completion: str) -> list:
    """Every reward on one completion, each call timed against the stall budget; returns all rewards."""
    calls = [
        lambda: retool_reward([completion] * len(TRUTHS), answer=TRUTHS),
        lambda: gsm8k_reward([completion] * len(TRUTHS), answer=[f"#### {t}" for t in TRUTHS]),
        lambda: verifyif_reward([completion], constraints=[ALL_CONSTRAINTS]),
        lambda: verifyif_strict_reward([[{"role": "assistant", "content": completion}]], constraints=[ALL_CONSTRAINTS]),
    ]
    rewards = []
    for call in calls:
        start = time.process_time()
        out = call()
        elapsed = time.process_time() - start
        assert elapsed < STALL_BUDGET_S, f"{elapsed:.2f} s for a {len(completion)}-character completion"
        assert all(isinstance(r, float) for r in out), out
        rewards += out
    return rewards


@pytest.mark.parametrize("completion", CRASHES_AND_STALLS.values(), ids=CRASHES_AND_STALLS.keys())
def test_every_reward_scores_every_hostile_completion(completion):
    _score_everything(completion)


@pytest.mark.parametrize("completion, truth", FALSE_POSITIVES.values(), ids=FALSE_POSITIVES.keys())
def test_no_reward_for_a_completion_that_does_not_state_the_truth(completion, truth):
    assert retool_reward([completion], answer=[truth]) == [-1.0]
    assert gsm8k_reward([completion], answer=[f"#### {truth}"]) == [0.0]
    assert verifyif_reward([completion], constraints=[ALL_CONSTRAINTS])[0] is not None


@pytest.mark.parametrize(
    "completion, truth, expected",
    [
        ("\\boxed{1e400}", "1e400", 1.0),  # beyond float range, still exact
        ("\\boxed{1e400}", "1e399", -1.0),
        ("\\boxed{" + "9" * 300 + "}", "9" * 300, 1.0),  # the largest mantissa accepted
        ("\\boxed{" + "9" * 300 + "}", "9" * 299 + "8", -1.0),
        ("\\boxed{" + "1" * 5000 + "}", "1" * 5000, -1.0),  # longer than MAX_ANSWER_CHARS: no answer
        ("\\boxed{1e100000000}", "1", -1.0),
        ("\\boxed{2 \\times 10^{100000000}}", "2", -1.0),
        ("\\boxed{1.5 \\times 10^{3}}", "1500", 1.0),
        ("\\boxed{123456790}", "123456789", -1.0),  # integers compare exactly (was within 1e-6)
        ("\\boxed{123456789.0001}", "123456789", -1.0),
        ("\\boxed{0.3333333}", "1/3", 1.0),  # a decimal may approximate a non-terminating value
        ("\\boxed{333333333}", "1000000000/3", -1.0),  # ... but an integer may not
        ("\\boxed{333333.5}", "1000001/3", -1.0),  # ... nor a decimal that is not its rounding
        ("\\boxed{333333.7}", "1000001/3", 1.0),
        ("\\boxed{1170 is wrong}", "1170", -1.0),  # trailing text is not a unit
        ("\\boxed{1170 cm}", "1170", 1.0),
        ("\\boxed{3 or 4}", "4", -1.0),  # a list of guesses is not one answer
        ("\\boxed{3, 4}", "4", -1.0),
        ("\\boxed{1 2 3}", "123", -1.0),  # spaces group thousands only in threes
        ("\\boxed{1 234}", "1234", 1.0),
        ("\\boxed{1/2/3}", "1/6", -1.0),
        ("\\boxed{}", "", -1.0),
    ],
)
def test_retool_values_after_the_fixes(completion, truth, expected):
    assert retool_reward([completion], answer=[truth]) == [expected]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("So #### ", 0.0),
        ("The answer is ", 0.0),
        (", ".join(str(i) for i in range(100)), 0.0),  # unmarked list of guesses
        ("\n".join(str(i) for i in range(100)), 0.0),
        ("#### 97, 98, 99", 0.0),
        ("#### 99", 1.0),
        ("The answer is: 99.", 1.0),
    ],
    ids=["truncated-####", "truncated-answer-is", "guess-list", "guess-lines", "marked-guesses", "marked", "phrase"],
)
def test_gsm8k_values_after_the_fixes(completion, expected):
    assert gsm8k_reward([completion], answer=["#### 99"]) == [expected]


@pytest.mark.parametrize(
    "constraint, field",
    [
        ({"type": "keywords_present", "keywords": "cat"}, "'keywords'"),  # a string where a list is meant
        ({"type": "keywords_forbidden", "keywords": []}, "'keywords'"),
        ({"type": "keywords_present", "keywords": ["ok", ""]}, "'keywords'"),
        ({"type": "word_count", "min": 5, "max": 1}, "greater than 'max'"),
        ({"type": "word_count", "min": -1}, "'min'"),
        ({"type": "word_count", "max": True}, "'max'"),
        ({"type": "keyword_frequency", "keyword": 3, "min": 1}, "'keyword'"),
        ({"type": "postscript", "marker": ""}, "'marker'"),
    ],
    ids=["keywords-str", "keywords-empty", "keywords-blank", "min-gt-max", "negative", "bool", "keyword-int", "marker"],
)
def test_malformed_constraints_are_refused_naming_the_field(constraint, field):
    with pytest.raises(ValueError, match=field) as info:
        verifyif_reward(["text"], constraints=[[{"type": "no_commas"}, constraint]])
    assert "constraints[1]" in str(info.value)


# Adversarial completions: pieces the parsers treat specially, repeated into long runs, plus raw unicode.
_PIECES = [
    "\n",
    ".",
    " ",
    "#",
    "####",
    "\\boxed{",
    "\\fbox{",
    "{",
    "}",
    "\\frac{",
    "\\dfrac",
    "\\sqrt{",
    "1",
    "9",
    "0",
    "e",
    "E",
    "^",
    "10^{",
    "\\times",
    "\\cdot",
    "/",
    ",",
    "\\,",
    "-",
    "+",
    "'",
    "*",
    "**",
    "[",
    "]",
    "<<",
    ">>",
    "```",
    "```json\n",
    "P.S.",
    "Section 1",
    "(",
    ")",
    "$",
    "\\$",
    "%",
    "\\%",
    "\u2212",
    "°",
    "^\\circ",
    "\\text{",
    "x = ",
    "answer is ",
    "Answer:",
    "The final answer is",
    "<|channel|>final<|message|>",
    "<|return|>",
    "<|end|>",
    "cm",
    "is wrong",
    "\t",
    "\r\n",
    "!",
    "?",
    "x",
    "\\pi",
    "\\Pi",
    "_",
    "|",
    "\\{",
    "\\left(",
    "\\right)",
    "\\sin",
    " not",
    "<|channel|>analysis<|message|>",
    "<|start|>assistant",
    "\ud800",
]
_RUN = st.tuples(st.sampled_from(_PIECES), st.integers(1, 3000)).map(lambda pair: pair[0] * pair[1])
_COMPLETION = st.lists(st.one_of(_RUN, st.text(max_size=50)), max_size=12).map(lambda parts: "".join(parts)[:100_000])


# derandomize: the same examples every run (no flaky CI, no .hypothesis/ example database written).
_SETTINGS = dict(deadline=None, derandomize=True, database=None)


@settings(max_examples=120, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **_SETTINGS)
@given(_COMPLETION)
def test_property_every_reward_is_a_float_within_budget(completion):
    _score_everything(completion)


@settings(max_examples=300, **_SETTINGS)
@given(st.one_of(_RUN, _COMPLETION, st.text()), st.sampled_from(TRUTHS))
def test_property_answer_helpers_are_total(text, truth):
    start = time.process_time()
    answer = extract_final_answer(text, fallback_to_last_number=True)
    assert answer is None or isinstance(answer, str)
    assert isinstance(answers_match(answer, truth), bool)
    assert isinstance(answers_match(text, truth), bool) and isinstance(answers_match(truth, text), bool)
    assert parse_number(text) is None or parse_number(text)[0] is not None
    assert time.process_time() - start < STALL_BUDGET_S


def test_last_boxed_reads_at_most_max_answer_chars():
    assert last_boxed("\\boxed{" + "a" * MAX_ANSWER_CHARS + "}") == "a" * MAX_ANSWER_CHARS
    assert last_boxed("\\boxed{" + "a" * (MAX_ANSWER_CHARS + 1) + "}") is None
    assert last_boxed("\\boxed" + " " * 8 + "{7}") == "7"
    assert last_boxed("\\boxed" + " " * 9 + "{7}") is None
    assert last_boxed("\\boxed{3} then \\boxed{4") is None  # a truncated last box is no answer
