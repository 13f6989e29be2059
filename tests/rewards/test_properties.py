"""Property tests: two answers whose values differ never match, however each is written.

Expressions are random trees over small integers and ``x``, rendered to LaTeX/plain text with random but
meaning-preserving choices (``\\frac`` or ``/``, ``\\cdot``/``*``/juxtaposition, redundant brackets,
spacing). Their exact values at ``x = 3/7`` are the oracle: different values, so a match is a false
positive. Near misses (one leaf changed, an operator swapped, a regrouping) are drawn beside random pairs.
"""

from fractions import Fraction

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trl_gptoss.rewards import answers_match, completion_text, gsm8k_reward, read_number, retool_reward

X = Fraction(3, 7)
_SETTINGS = dict(deadline=None, derandomize=True, database=None)
_PRECEDENCE = {"+": 1, "-": 1, "neg": 1.5, "*": 2, "/": 2, "^": 4, "num": 5, "x": 5}  # -a*b is -(a*b)

_LEAF = st.one_of(st.integers(0, 12).map(lambda n: ("num", n)), st.just(("x",)))


def _extend(children):
    binary = st.tuples(st.sampled_from(["+", "-", "*", "/"]), children, children)
    power = st.tuples(st.just("^"), children, st.integers(0, 3).map(lambda n: ("num", n)))
    return st.one_of(binary, power, st.tuples(st.just("neg"), children))


EXPR = st.recursive(_LEAF, _extend, max_leaves=8)


def value(tree) -> Fraction | None:
    """Exact value at ``x = X``; ``None`` when a division by zero occurs."""
    try:
        return _value(tree)
    except ZeroDivisionError:
        return None


def _value(tree) -> Fraction:
    kind = tree[0]
    if kind == "num":
        return Fraction(tree[1])
    if kind == "x":
        return X
    if kind == "neg":
        return -_value(tree[1])
    a, b = _value(tree[1]), _value(tree[2])
    if kind == "^" and a == 0 and b <= 0:
        raise ZeroDivisionError("0^0 or 0^-n")
    return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b, "^": lambda: a ** int(b)}[
        kind
    ]()


def render(tree, draw) -> str:
    """A string whose standard reading is ``tree``; brackets where precedence needs them, and at random."""
    text = _render(tree, draw)
    return f"({text})" if draw(st.integers(0, 9)) == 0 else text


def _wrapped(text: str) -> bool:
    """Whether one pair of brackets encloses all of ``text``."""
    depth = 0
    for i, ch in enumerate(text):
        depth += 1 if ch == "(" else -1 if ch == ")" else 0
        if depth == 0:
            return i == len(text) - 1
    return False


def _wrap(child, parent_precedence, draw, strict=False) -> str:
    text = render(child, draw)
    weaker = _PRECEDENCE[child[0]] < parent_precedence or (strict and _PRECEDENCE[child[0]] == parent_precedence)
    return f"({text})" if weaker and not _wrapped(text) else text


def _render(tree, draw) -> str:
    kind = tree[0]
    if kind == "num":
        return str(tree[1])
    if kind == "x":
        return "x"
    if kind == "neg":
        return "-" + _wrap(tree[1], 2, draw)  # -(...) around a sum
    if kind == "^":
        base = render(tree[1], draw)
        base = base if tree[1][0] in ("num", "x") and not base.startswith("-") or _wrapped(base) else f"({base})"
        exponent = tree[2][1]
        return f"{base}^{{{exponent}}}" if draw(st.booleans()) or exponent < 0 else f"{base}^{exponent}"
    if kind == "/" and draw(st.booleans()):
        return f"\\frac{{{render(tree[1], draw)}}}{{{render(tree[2], draw)}}}"
    left = _wrap(tree[1], _PRECEDENCE[kind], draw)
    right = _wrap(tree[2], _PRECEDENCE[kind], draw, strict=True)  # a+(b+c) is not read as (a+b)+c
    if kind == "/":
        left = f"({left})" if tree[1][0] == "/" and not _wrapped(left) else left
        return f"{left}/{right}"
    if kind == "*":
        # x(...) may be a function applied: only a number or a power juxtaposes with a bracket
        juxtapose = tree[1][0] in ("num", "x", "^") and (right[0].isalpha() or (right[0] == "(" and tree[1][0] != "x"))
        return left + draw(st.sampled_from([" \\cdot ", "*", " * ", "\\cdot "] + ["", " "] * juxtapose)) + right
    return left + draw(st.sampled_from([kind, f" {kind} "])) + right


def _near_miss(tree, draw):
    """``tree`` with one leaf changed, one operator swapped or one subtree regrouped."""
    kind = tree[0]
    if kind == "num":
        return ("num", tree[1] + draw(st.sampled_from([-1, 1, 10])))
    if kind == "x":
        return ("num", draw(st.integers(0, 3)))
    if kind == "neg":
        return tree[1] if draw(st.booleans()) else ("neg", _near_miss(tree[1], draw))
    choice = draw(st.integers(0, 3))
    if choice == 0 and kind in "+-*/":
        return (draw(st.sampled_from([op for op in "+-*/" if op != kind])), tree[1], tree[2])
    if choice == 1 and tree[2][0] in "+-*/" and kind in "+-*/":  # a op (b op2 c) -> (a op b) op2 c
        inner = tree[2]
        return (inner[0], (kind, tree[1], inner[1]), inner[2])
    if choice == 2:
        return (kind, _near_miss(tree[1], draw), tree[2])
    return (kind, tree[1], _near_miss(tree[2], draw))


@settings(max_examples=400, **_SETTINGS)
@given(EXPR, st.data())
def test_property_near_misses_never_match(tree, data):
    other = _near_miss(tree, data.draw)
    a, b = value(tree), value(other)
    assume(a is not None and b is not None and a != b)
    truth, prediction = render(tree, data.draw), render(other, data.draw)
    assert not answers_match(prediction, truth), (prediction, truth)
    assert not answers_match(truth, prediction), (truth, prediction)
    assert retool_reward([f"\\boxed{{{prediction}}}"], answer=[truth]) == [-1.0]


@settings(max_examples=300, **_SETTINGS)
@given(EXPR, EXPR, st.data())
def test_property_different_values_never_match(tree, other, data):
    a, b = value(tree), value(other)
    assume(a is not None and b is not None and a != b)
    truth, prediction = render(tree, data.draw), render(other, data.draw)
    assert not answers_match(prediction, truth), (prediction, truth)


@settings(max_examples=300, **_SETTINGS)
@given(EXPR, st.data())
def test_property_two_renderings_of_one_tree_match(tree, data):
    """Not soundness but a guard that the structural reading is not vacuous: brackets, ``\\frac`` vs
    ``/``, ``\\cdot`` vs ``*`` and spacing do not change an answer."""
    a, b = render(tree, data.draw), render(tree, data.draw)
    assert answers_match(a, b), (a, b)


def _number_forms(value: Fraction) -> list[str]:
    """Exact written forms of ``value`` (no decimal approximations)."""
    forms = [f"{value.numerator}/{value.denominator}", f"\\frac{{{value.numerator}}}{{{value.denominator}}}"]
    if value.denominator == 1:
        n = value.numerator
        forms += [str(n), f"{n:,}", f"{n} apples", f"x = {n}", f"{n}cm", f"$ {n} $"]
    return forms


@settings(max_examples=300, **_SETTINGS)
@given(st.fractions(max_denominator=50).filter(lambda f: abs(f) < 10**6), st.integers(-3, 3), st.data())
def test_property_different_numbers_never_match(truth, delta, data):
    prediction = truth + Fraction(delta, data.draw(st.sampled_from([1, 7, 1000, 10**7])))
    assume(prediction != truth)
    for written in _number_forms(prediction):
        for true_text in _number_forms(truth):
            assert not answers_match(written, true_text), (written, true_text)


@settings(max_examples=300, **_SETTINGS)
@given(st.fractions(max_denominator=30), st.integers(1, 12), st.integers(-20, 20))
def test_property_a_decimal_matches_only_a_value_it_rounds(truth, places, offset):
    """A written decimal ``d`` with ``k`` places matches an exact non-terminating ``t`` only when it is ``t``
    rounded to nearest or toward zero at ``k`` places, with 6+ significant digits."""
    scale = 10**places
    d = Fraction(round(truth * scale) + offset, scale)
    written = f"{'-' if d < 0 else ''}{abs(d.numerator * scale // d.denominator) // scale}." + (
        f"{abs(d.numerator * scale // d.denominator) % scale:0{places}d}"
    )
    assume(read_number(written) is not None and read_number(written).value == d)
    true_text = f"{truth.numerator}/{truth.denominator}"
    if answers_match(written, true_text):
        scaled = truth * scale
        assert d == truth or d in (Fraction(round(scaled), scale), Fraction(int(scaled), scale)), written
        assert d == truth or read_number(written).significant >= 6


TAIL = st.lists(st.sampled_from(list("0123456789 \\{}#|<>") + ["\\boxed{", "#### ", "<|end|>", "7", "\\boxed{7}"])).map(
    "".join
)


@settings(max_examples=200, **_SETTINGS)
@given(
    st.sampled_from(["\\boxed{7}", "#### 7", "The answer is 7", "\\boxed{8}"]),
    TAIL,
    st.sampled_from(["<|end|>", "<|return|>", "<|call|>", "<|end|><|start|>assistant<|channel|>analysis<|message|>"]),
)
def test_property_text_after_the_final_message_is_never_scored(answer, tail, stop):
    message = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>" + answer
    assert completion_text(message + stop + tail) == answer
    expected = 1.0 if "7" in answer else 0.0
    assert gsm8k_reward([message + stop + tail], answer=["#### 7"]) == [expected]
