"""A disguise must not change a verdict: magnitude words after a number, invisible and look-alike characters.

Each property draws generated variants of one false positive that an earlier version paid (issue #32,
finding 2) and states that no variant is paid now.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_gptoss.rewards import answers_match, check_constraint, gsm8k_reward, retool_reward
from trl_gptoss.rewards.normalize import COMMAS

_SETTINGS = dict(deadline=None, derandomize=True, database=None)


def _words(text: str) -> list[str]:
    return text.split()


# ---- a word after a number that changes it -----------------------------------------------------------------
_CHANGING_WORDS = _words(
    "hundred thousand million billion trillion quadrillion zillion dozen score gross grand lakh crore half "
    "halves third quarter fifth tenth twelfth hundredth thousandth millionth squared cubed square cube factorial "
    "inverse reciprocal root power fold"
)


@settings(max_examples=300, **_SETTINGS)
@given(
    st.integers(1, 10**6),
    st.sampled_from(_CHANGING_WORDS),
    st.booleans(),
    st.sampled_from([str.lower, str.upper, str.title]),
)
def test_property_a_changing_word_never_matches_the_bare_number(number, word, plural, case):
    word = case(word + ("s" if plural and not word.endswith("s") else ""))
    answer = f"{number:,} {word}" if number % 2 else f"{number} {word}"
    assert not answers_match(answer, str(number)), answer
    assert retool_reward([f"\\boxed{{{answer}}}"], answer=[str(number)]) == [-1.0], answer
    assert gsm8k_reward([f"#### {answer}"], answer=[f"#### {number}"]) == [0.0], answer
    assert gsm8k_reward([f"The answer is {answer}."], answer=[f"#### {number}"]) == [0.0], answer


# Multipliers and groups (``5 doubled`` is 10, ``5 pairs`` 10 things), any past participle (something done to the
# number) and ``-fold`` / ``-uple`` words; beside them, the nouns a count carries, which must still match.
_MULTIPLIERS = _words(
    "doubled halved twice pairs double triple tripled quadrupled halve thrice pair couple couples brace trio "
    "quartet twins triplets fivefold twofold sextuple quintuples"
)
_PARTICIPLE = st.text("abcdfghijklmnoprstuvwxyz", min_size=2, max_size=9).map(lambda stem: stem + "ed")
_COUNTED_NOUNS = _words("apples pears pairings seeds speed beds sheds sleds feet hours marbles coupons tires")


def _written(number: int, word: str, case, period: bool) -> str:
    return (f"{number:,} " if number % 2 else f"{number} ") + case(word) + ("." if period else "")


@settings(max_examples=300, **_SETTINGS)
@given(
    st.integers(1, 10**6),
    st.one_of(st.sampled_from(_MULTIPLIERS), _PARTICIPLE.filter(lambda w: w not in ("bed", "shed", "sled", "bred"))),
    st.sampled_from([str.lower, str.upper, str.title]),
    st.booleans(),
)
def test_property_a_multiplier_or_an_operation_word_never_matches_the_bare_number(number, word, case, period):
    answer = _written(number, word, case, period)
    assert not answers_match(answer, str(number)), answer
    assert retool_reward([f"\\boxed{{{answer}}}"], answer=[str(number)]) == [-1.0], answer
    assert gsm8k_reward([f"#### {answer}"], answer=[f"#### {number}"]) == [0.0], answer


@settings(max_examples=200, **_SETTINGS)
@given(
    st.integers(1, 10**6),
    st.sampled_from(_COUNTED_NOUNS),
    st.sampled_from([str.lower, str.title]),
    st.booleans(),
)
def test_property_a_counted_noun_after_the_number_still_matches(number, word, case, period):
    answer = _written(number, word, case, period)
    assert answers_match(answer, str(number)), answer
    assert retool_reward([f"\\boxed{{{answer}}}"], answer=[str(number)]) == [1.0], answer


# ---- VerifyIf: what a reader sees ---------------------------------------------------------------------------
_INVISIBLE = ["\u200b", "\u00ad", "\u2060", "\ufeff", "\u200c", "\u200d", "\u034f", "\ufe0f", "\u2066", "\u180e"]
_CYRILLIC = dict(zip("aceopxyijsABCEHKMOPTXY", "асеорхуіјѕАВСЕНКМОРТХУ"))


def _disguises(letter: str) -> list[str]:
    """Ways to write ``letter`` that read as it: itself, full-width, mathematical bold/italic/double-struck,
    a Cyrillic look-alike."""
    forms = [letter, chr(ord(letter) + 0xFEE0)]
    if letter.isupper():
        forms += [chr(0x1D400 + ord(letter) - 65), chr(0x1D434 + ord(letter) - 65)]
    else:
        forms += [chr(0x1D41A + ord(letter) - 97), chr(0x1D552 + ord(letter) - 97)]
    return forms + ([_CYRILLIC[letter]] if letter in _CYRILLIC else [])


# Latin small capitals (no x), which NFKC leaves as they are, and modifier letters, which it folds.
_SMALL_CAPITALS = dict(
    zip(
        "abcdefghijklmnopqrstuvwyz",
        "\u1d00\u0299\u1d04\u1d05\u1d07\ua730\u0262\u029c\u026a\u1d0a\u1d0b\u029f\u1d0d\u0274\u1d0f\u1d18\ua7af\u0280\ua731\u1d1b\u1d1c\u1d20\u1d21\u028f\u1d22",
    )
)
_MODIFIERS = dict(zip("acemopstx", "\u1d43\u1d9c\u1d49\u1d50\u1d52\u1d56\u02e2\u1d57\u02e3"))


@st.composite
def _disguised(draw, word: str, cyrillic: bool = True, small_capitals: bool = False) -> str:
    out = []
    for letter in word:
        forms = _disguises(letter)
        if not cyrillic and letter in _CYRILLIC:
            forms = forms[:-1]
        if small_capitals:
            forms = forms + [m[letter] for m in (_SMALL_CAPITALS, _MODIFIERS) if letter in m]
        out.append(draw(st.sampled_from(forms)))
        out.append(draw(st.sampled_from(["", "", *_INVISIBLE])))
    return "".join(out[:-1])


_FILLER = st.lists(st.sampled_from(_words("the a dog ran over hill and far away")), max_size=6).map(" ".join)
_KEYWORDS = ["cat", "money", "secret", "paper", "apex"]


@settings(max_examples=300, **_SETTINGS)
@given(st.sampled_from(_KEYWORDS), st.data())
def test_property_a_disguised_forbidden_keyword_is_still_forbidden(keyword, data):
    shown = data.draw(_disguised(keyword, small_capitals=True))
    text = f"{data.draw(_FILLER)} {shown} {data.draw(_FILLER)}"
    assert not check_constraint(text, {"type": "keywords_forbidden", "keywords": [keyword]}), ascii(text)
    assert not check_constraint(text, {"type": "keyword_frequency", "keyword": keyword, "max": 0}), ascii(text)


@settings(max_examples=200, **_SETTINGS)
@given(st.sampled_from(_KEYWORDS), st.data())
def test_property_a_keyword_must_be_present_in_letters_that_read_as_it(keyword, data):
    """Full-width, bold and invisible characters still show the keyword; a Cyrillic look-alike never earns it."""
    shown = data.draw(_disguised(keyword, cyrillic=False))
    text = f"{data.draw(_FILLER)} {shown}."
    assert check_constraint(text, {"type": "keywords_present", "keywords": [keyword]}), ascii(text)
    fake = shown.replace(keyword[0], _CYRILLIC.get(keyword[0], keyword[0]))
    if fake != shown:
        assert not check_constraint(fake, {"type": "keywords_present", "keywords": [keyword]}), ascii(fake)


@settings(max_examples=300, **_SETTINGS)
@given(st.text("abcdefghij ", min_size=1, max_size=30), st.data())
def test_property_one_disguised_capital_breaks_all_lowercase(text, data):
    capital = data.draw(st.sampled_from("ABCDEHKMOPTXY"))
    position = data.draw(st.integers(0, len(text)))
    shown = data.draw(_disguised(capital, cyrillic=data.draw(st.booleans())))
    mixed = text[:position] + shown + text[position:]
    assert not check_constraint(mixed, {"type": "all_lowercase"}), ascii(mixed)
    upper = mixed.upper().replace(shown.upper(), data.draw(_disguised(capital.lower())))
    assert not check_constraint(upper, {"type": "all_uppercase"}), ascii(upper)


# Written out here, not read from ``COMMAS``: the low acute and low grave modifiers, the turned comma, a comma
# below a digit, and NFKC's commas (full-width, small, half-width ideographic, small ideographic).
_COMMA_SHAPES = ["\u02cf", "\u02ce", "\u2e32", "5\u0326", "\uff0c", "\ufe50", "\uff64", "\ufe51"]


@settings(max_examples=200, **_SETTINGS)
@given(st.text("abc def.", max_size=30), st.sampled_from([*COMMAS, *_COMMA_SHAPES]), st.data())
def test_property_anything_that_reads_as_a_comma_is_a_comma(text, comma, data):
    position = data.draw(st.integers(0, len(text)))
    shown = text[:position] + comma + data.draw(st.sampled_from(["", *_INVISIBLE])) + text[position:]
    assert not check_constraint(shown, {"type": "no_commas"}), ascii(shown)


@settings(max_examples=200, **_SETTINGS)
@given(
    st.lists(st.sampled_from(_words("alpha beta gamma delta one two")), min_size=1, max_size=12),
    st.lists(st.sampled_from([" ", "_", "__", " _ ", "\t", "_\u200b"]), min_size=11, max_size=11),
)
def test_property_underscores_separate_words(words, joints):
    text = words[0] + "".join(j + w for j, w in zip(joints, words[1:]))
    assert check_constraint(text, {"type": "word_count", "exactly": len(words)}), ascii(text)


@pytest.mark.parametrize(
    "text, constraint",
    [
        ("the c\u200bat", {"type": "keywords_forbidden", "keywords": ["cat"]}),
        ("the ca\u00adt", {"type": "keywords_forbidden", "keywords": ["cat"]}),
        ("the ca\u2060t", {"type": "keywords_forbidden", "keywords": ["cat"]}),
        ("the \uff43\uff41\uff54", {"type": "keywords_forbidden", "keywords": ["cat"]}),
        ("the \u0441\u0430t", {"type": "keywords_forbidden", "keywords": ["cat"]}),
        ("the_cat_sat", {"type": "keywords_forbidden", "keywords": ["cat"]}),
        ("one\u201a two", {"type": "no_commas"}),
        ("one\u3001two", {"type": "no_commas"}),
        ("one\u02cf two", {"type": "no_commas"}),
        ("the \u1d04at", {"type": "keywords_forbidden", "keywords": ["cat"]}),
        ("the \u1d04\u1d00\u1d1b", {"type": "keyword_frequency", "keyword": "cat", "max": 0}),
        ("hello \U0001d416orld", {"type": "all_lowercase"}),
        ("HELLO \U0001d430", {"type": "all_uppercase"}),
        ("one_two_three four", {"type": "word_count", "max": 2}),
    ],
    ids=[
        "zero-width-space",
        "soft-hyphen",
        "word-joiner",
        "full-width",
        "cyrillic",
        "underscores",
        "low-9-quote",
        "ideographic-comma",
        "low-acute-modifier",
        "small-capital-c",
        "small-capitals",
        "bold-capital",
        "bold-small",
        "underscored-words",
    ],
)
def test_the_reported_disguises_fail_their_constraint(text, constraint):
    assert not check_constraint(text, constraint)
