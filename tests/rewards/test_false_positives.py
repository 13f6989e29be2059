"""A false positive is a reward hack: each case here was scored as a match by an earlier version.

Classes (docs/tools_and_rewards.md, "Rewards' contract"): grouping lost in text comparison, implicit
multiplication read as digits, a relative tolerance wider than the written precision, a negation or any
word read as a unit, text after the final Harmony message scored, nested and repeated boxes.
"""

import pytest

from trl_gptoss.rewards import answers_match, completion_text, gsm8k_reward, last_boxed, retool_reward

DIFFERENT = [
    # grouping: structure, not stripped text
    ("2x+1", "2(x+1)"),
    ("\\sqrt{3/2}", "\\sqrt{3}/2"),
    ("\\sqrt{2}3", "\\sqrt{23}"),
    ("a/(b+c)", "a/b+c"),
    ("\\frac{a}{b+c}", "\\frac{a}{b}+c"),
    ("e^{x+1}", "e^x+1"),
    ("-x^2", "(-x)^2"),
    ("\\frac{1}{2x}", "\\frac{1}{2}x"),
    ("1/2x", "\\frac{1}{2}x"),  # ambiguous: 1/(2x) or x/2
    ("x^23", "x^{2}3"),  # LaTeX reads x^23 as x^2 3
    ("1 2\\pi", "12\\pi"),
    ("2\\frac{1}{2}", "2 \\cdot \\frac{1}{2}"),  # a mixed number (5/2) or a product (1)?
    ("f(x+1)", "f \\cdot (x+1)"),  # f may be a function
    # case of symbols
    ("\\Pi", "\\pi"),
    ("\\Gamma", "\\gamma"),
    ("XY", "xy"),
    ("A", "a"),
    # implicit multiplication is never a digit string
    ("2(3)", "23"),
    ("(2)(3)", "23"),
    ("2{3}", "23"),
    ("1\\frac{1}{2}", "11/2"),
    ("\\frac{1}{2}3", "1/23"),
    # tolerance scaled by the written precision
    ("333333.5", "1000001/3"),
    ("0.33333", "1/3"),  # too few significant digits to approximate
    ("0.3333334", "1/3"),  # neither rounded nor truncated
    ("66.6665", "200/3"),
    ("66.667", "200/3"),  # rounded, but 5 significant digits
    # a negation, a conjunction or a variable is not a unit
    ("1170 not", "1170"),
    ("1170 no", "1170"),
    ("1170 never", "1170"),
    ("1170 wrong", "1170"),
    ("1170 or", "1170"),
    ("1170 nor", "1170"),
    ("not 1170", "1170"),
    ("1170 isn't", "1170"),
    ("5x", "5"),
    ("5e", "5"),
    ("5 x", "5"),
    # numbers
    ("1.000", "1000"),
    ("1,0", "10"),
]
# A magnitude, number, fraction or operation word after a number changes it: it is not a unit.
CHANGED_BY_THE_WORD = [
    ("5 thousand", "5"),
    ("5 million", "5"),
    ("2 billion", "2"),
    ("3 hundred", "3"),
    ("4 dozen", "4"),
    ("3 halves", "3"),
    ("5 squared", "5"),
    ("2 cubed", "2"),
    ("6 factorial", "6"),
    ("5 tenths", "5"),
    ("9 inverse", "9"),
    ("7 Thousand", "7"),
    ("2 zillion", "2"),
    ("3 trillionths", "3"),
    ("5 square", "5"),
    ("8 reciprocal", "8"),
    ("1.5 thousands", "1.5"),
]
SAME = [
    ("333333.7", "1000001/3"),  # 1000001/3 rounded at the answer's own precision
    ("0.3333333", "1/3"),
    ("0.333333", "1/3"),
    ("0.6666667", "2/3"),
    ("0.6666666", "2/3"),  # truncated
    ("33.33333%", "1/3"),
    ("1,000", "1000"),
    ("-0", "0"),
    ("+5", "5"),
    ("5%", "0.05"),
    ("1e3", "1000"),
    ("\u22123", "-3"),
    ("{12}", "12"),
    ("1{,}234", "1234"),
    ("-(7)", "-7"),
    ("12cm", "12"),
    ("12 apples", "12"),
    ("5 m/s", "5"),
    ("2(x+1)", "2 \\cdot (x+1)"),
    ("\\frac{a+b}{2}", "(a+b)/2"),
    ("\\left( x+1 \\right)", "x+1"),
    ("\\dfrac{\\sqrt{3}}{2}", "\\sqrt3/2"),
    ("2\\sqrt{3}", "2 * \\sqrt{3}"),
    ("x^{2}", "x^2"),
    ("[1, 2)", "[1,2)"),
    ("Paris.", "paris"),
    ("\\text{Yes}", "yes"),
]


@pytest.mark.parametrize("prediction, truth", DIFFERENT, ids=[f"{p} vs {t}" for p, t in DIFFERENT])
def test_different_answers_never_match(prediction, truth):
    assert not answers_match(prediction, truth)
    assert not answers_match(truth, prediction)


@pytest.mark.parametrize("answer, truth", CHANGED_BY_THE_WORD, ids=[a for a, _ in CHANGED_BY_THE_WORD])
def test_a_magnitude_or_operation_word_is_not_a_unit(answer, truth):
    assert not answers_match(answer, truth)
    assert retool_reward([f"So \\boxed{{{answer}}}"], answer=[truth]) == [-1.0]
    assert gsm8k_reward([f"#### {answer}"], answer=[f"#### {truth}"]) == [0.0]
    assert gsm8k_reward([f"The answer is {answer}."], answer=[f"#### {truth}"]) == [0.0]
    assert answers_match(f"{truth} apples", truth), "a word that names what is counted stays a unit"


@pytest.mark.parametrize("prediction, truth", SAME, ids=[f"{p} vs {t}" for p, t in SAME])
def test_same_answers_still_match(prediction, truth):
    assert answers_match(prediction, truth)


HARMONY = [
    # text after the final message's stop token is not part of the answer
    ("<|channel|>final<|message|>\\boxed{1}<|end|> \\boxed{2}", "2", -1.0),
    ("<|channel|>final<|message|>\\boxed{1}<|return|>\\boxed{2}", "2", -1.0),
    ("<|channel|>final<|message|>\\boxed{1}<|end|><|start|>user<|message|>\\boxed{2}", "2", -1.0),
    ("<|channel|>final<|message|>\\boxed{2}<|end|> \\boxed{1}", "2", 1.0),
    # a Harmony completion without a final message has no answer (analysis is not scored)
    ("<|channel|>analysis<|message|>\\boxed{2}<|end|>", "2", -1.0),
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>\\boxed{2}", "2", 1.0),
    # a final message prefilled by the prompt: the body up to its stop token
    ("\\boxed{2}<|return|>", "2", 1.0),
    ("\\boxed{1}<|return|> \\boxed{2}", "2", -1.0),
]


@pytest.mark.parametrize("completion, truth, expected", HARMONY, ids=range(len(HARMONY)))
def test_only_the_final_message_is_scored(completion, truth, expected):
    assert retool_reward([completion], answer=[truth]) == [expected]
    assert gsm8k_reward([completion], answer=[f"#### {truth}"]) == [max(expected, 0.0)]


def test_completion_text_cuts_at_the_final_messages_stop_token():
    assert completion_text("<|channel|>final<|message|>It is 4<|end|>tail") == "It is 4"
    assert completion_text([{"role": "assistant", "content": "a<|return|>b"}]) == "a"
    assert completion_text(None) == ""


BOXES = [
    ("\\boxed{3 + \\boxed{4}}", "4", -1.0),  # the outer box is the answer
    ("\\boxed{\\boxed{4}}", "4", 1.0),
    ("\\boxed{3} or \\boxed{4}", "4", -1.0),  # every box must state the answer: guesses earn nothing
    ("\\boxed{4}, \\boxed{4.0}", "4", 1.0),
    ("\\boxed{" + "}\\boxed{".join(map(str, range(20))) + "}", "19", -1.0),
    ("\\boxed{3 \\boxed{4}", "4", -1.0),  # an unclosed box swallows the rest
]


@pytest.mark.parametrize("completion, truth, expected", BOXES, ids=range(len(BOXES)))
def test_nested_and_repeated_boxes(completion, truth, expected):
    assert retool_reward([completion], answer=[truth]) == [expected]


def test_last_boxed_is_the_last_outer_box():
    assert last_boxed("\\boxed{3 + \\boxed{4}}") == "3 + \\boxed{4}"
    assert last_boxed("\\boxed{\\boxed{4}}") == "4"


def test_repeated_gsm8k_markers_must_agree():
    assert gsm8k_reward(["#### 3\n#### 4"], answer=["#### 4"]) == [0.0]
    assert gsm8k_reward(["#### 4\n#### 4"], answer=["#### 4"]) == [1.0]


def test_none_and_non_text_truths_never_raise():
    assert not answers_match("3", None)
    assert retool_reward([None, "\\boxed{3}"], answer=[3, 3]) == [-1.0, 1.0]
    assert gsm8k_reward(["#### \ud800"], answer=["#### 3"]) == [0.0]
