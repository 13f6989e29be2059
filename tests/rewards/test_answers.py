"""Final-answer extraction and numeric-aware matching: tables of known answers, tricky formatting."""

from fractions import Fraction

import pytest

from trl_gptoss.rewards import answers_match, completion_text, extract_final_answer, last_boxed, parse_number

MATCHING = [
    ("\\frac{3}{4}", "0.75"),
    ("\\dfrac34", "3/4"),
    ("-\\frac{1}{2}", "-0.5"),
    ("\\frac{-1}{2}", "-1/2"),
    ("1,234,567", "1234567"),
    ("1\\,234", "1234"),
    ("$1,234.50", "1234.5"),
    ("\\$12", "12"),
    ("-$5", "-5"),
    ("50\\%", "50"),
    ("50%", "0.5"),
    ("12 cm", "12"),
    ("12\\text{ apples}", "12"),
    ("90^\\circ", "90"),
    ("90°", "90"),
    ("x = 5", "5"),
    ("1.5 \\times 10^{3}", "1500"),
    ("2.5e-3", "0.0025"),
    ("\u22123", "-3"),
    ("6/8", "3/4"),
    ("0.3333333", "1/3"),
    ("(-7)", "-7"),
    ("07", "7"),
    ("\\pi/2", "\\frac{\\pi}{2}"),
    ("\\sqrt{3}", "\\sqrt3"),
    ("(1, 2)", "(1,2)"),
    ("Paris.", "paris"),
]
NOT_MATCHING = [
    ("2", "3"),
    ("1,23", "123"),
    ("0.33", "1/3"),
    ("-5", "5"),
    ("12", "1.2"),
    ("50%", "5"),
    ("1/0", "0"),
    (None, "3"),
    ("", "0"),
    ("\\frac{1}{3}", "0.333"),
    ("x", "y"),
]


@pytest.mark.parametrize("prediction, truth", MATCHING, ids=[p for p, _ in MATCHING])
def test_equivalent_answers_match(prediction, truth):
    assert answers_match(prediction, truth)
    assert answers_match(truth, prediction)


@pytest.mark.parametrize("prediction, truth", NOT_MATCHING, ids=[str(p) for p, _ in NOT_MATCHING])
def test_different_answers_do_not_match(prediction, truth):
    assert not answers_match(prediction, truth)


def test_parse_number_values():
    assert parse_number("\\frac{3}{4}") == (Fraction(3, 4), False)
    assert parse_number("-25\\%") == (Fraction(-25), True)
    assert parse_number("1,234.5 cm") == (Fraction(2469, 2), False)
    assert parse_number("seven") is None and parse_number("1,2,3") is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{\\frac{1}{2}} and finally \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\fbox{42}", "42"),
        ("unbalanced \\boxed{12", None),
        ("no box here", None),
    ],
    ids=["last-of-two", "nested-braces", "fbox", "unbalanced", "none"],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 + 4 = 7\n#### 7", "7"),
        ("The final answer is $1,200.", "$1,200"),
        ("Answer: 18 apples\nthanks", "18 apples"),
        ("#### 3\nno wait\n#### 4", "4"),
        ("The answer is:\n\n  42.", "42"),
        ("I think 3, no wait, 5", None),
        ("nothing numeric", None),
    ],
    ids=["gsm8k-marker", "answer-is", "answer-colon", "last-marker", "answer-next-line", "unmarked", "none"],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("value \u22124", "-4"),
        ("so it is\n  12 apples  \n", "12"),
        ("I think 3, no wait, 5", None),
        ("1\n2\n3", "3"),
    ],
    ids=["unicode-minus", "last-line", "two-numbers-on-last-line", "one-per-line"],
)
def test_last_number_fallback_is_opt_in_and_takes_a_lone_number(text, expected):
    """Evaluation-only fallback: the last line must hold exactly one number; no reward uses it."""
    assert extract_final_answer(text) is None
    assert extract_final_answer(text, fallback_to_last_number=True) == expected


def test_completion_text_forms():
    assert completion_text("plain") == "plain"
    messages = [
        {"role": "assistant", "content": "first"},
        {"role": "tool", "content": "x"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "last "}, {"type": "text", "text": "one"}],
        },
    ]
    assert completion_text(messages) == "last one"
    harmony = (
        "<|channel|>analysis<|message|>think \\boxed{1}<|end|><|start|>assistant"
        "<|channel|>final<|message|>It is \\boxed{2}<|return|>"
    )
    assert completion_text(harmony) == "It is \\boxed{2}"
    with pytest.raises(ValueError, match="str or a list of messages"):
        completion_text(42)
