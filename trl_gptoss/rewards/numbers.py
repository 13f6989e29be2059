"""Bounded parsing of one written number into an exact ``Fraction`` and the precision it was written with.

Model output is untrusted, so every step is linear in the answer's length and no step builds a huge value:

- an answer longer than ``MAX_ANSWER_CHARS`` characters is not a number;
- a mantissa has at most ``MAX_DIGITS`` digits (Python refuses ``int()`` of more than 4300 digits, and
  far smaller answers are all a math task ever has);
- a decimal exponent (``2.5e-3``, ``1.5 \\times 10^{3}``) has ``|e| <= MAX_EXPONENT`` (``10**e`` for
  ``e = 10**8`` takes minutes);
- at most one ``/`` and one ``\\times 10^{e}``: parsing never recurses, so nesting cannot overflow the stack.

Anything beyond these bounds is "not a number" (``None``); the caller then compares the answer as structure.
So the largest value ever built is below ``10**(2 * (MAX_DIGITS + 2 * MAX_EXPONENT))``: microseconds.

Grouping is never dropped: only brackets that wrap a whole operand are removed (``(-7)``, ``\\frac{1}{2}``'s
``(1)/(2)``), so ``2(3)``, ``(2)(3)`` and ``1\\frac{1}{2}`` are not numbers (they are not ``23`` or ``11/2``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

MAX_ANSWER_CHARS = 400
MAX_DIGITS = 300
MAX_EXPONENT = 400


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


FRAC = re.compile(r"\\[dt]?frac\s*(?:\{([^{}]*)\}|(\d))\s*(?:\{([^{}]*)\}|(\d))")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w{0,20}\s*=\s*")  # "x = 5" states 5
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACED_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?: \d{3})+(?:\.\d+)?$")
_COMMA_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL = re.compile(r"^([-+]?)(\d*)(?:(\.)(\d*))?(?:[eE]([-+]?\d{1,6}))?$")
_TIMES_TEN = re.compile(r"(?:\\times|\\cdot|\*|x)\s*10\s*\^\s*(?:\{\s*([-+]?\d{1,6})\s*\}|([-+]?\d{1,6}))$")
# A unit is ONE word (optionally "square"/"cubic" before it, a power or "/word" after it) or a degree sign.
_WITH_UNIT = re.compile(
    r"^([-+]?[\d.,/(){}]+(?:[eE][-+]?\d+)?)(\s*)"
    r"(?:\^\s*\\circ|°|(?:(?:square|sq\.?|cubic)\s+)?([A-Za-z]{1,20})\.?(?:\^\s*\{?[23]\}?|/[A-Za-z]{1,10})?)$"
)
# Unit symbols that may follow a number without a space ("12cm", "5 m/s"). Other single letters are
# variables: "5x" and "5e" are not 5.
_UNIT_SYMBOLS = _words(
    "mm cm m km in ft yd mi mg g kg lb lbs oz mL ml L s sec min h hr hrs ms mph kph K J kJ W kW V A N Pa "
    "Hz cal kcal gal qt pt ha deg rad px GB MB kB"
)
# A word of three or more letters after a space is a unit ("12 apples"), except these: a negation, a
# hedge or a conjunction states something other than the number ("1170 not", "1170 or").
NOT_UNITS = _words(
    "not nor never nope none nothing neither either wrong incorrect false invalid impossible isnt arent "
    "wasnt werent aint cannot cant wont dont doesnt didnt maybe perhaps possibly probably approx "
    "approximately about around roughly nearly almost and but yet than then also plus minus times over "
    "less more least most unless except without instead otherwise else unknown undefined wait hmm "
    "actually guess"
)
# Nor is a word that changes the number: a magnitude (``5 thousand`` is 5000, ``4 dozen`` 48), a number or a
# fraction word (``3 halves``, ``5 tenths``, ``2 twelfths``) or an operation (``5 squared``, ``6 factorial``,
# ``9 inverse``). A word ending in "illion(s)" or "illionth(s)" is a magnitude too (``2 zillion``).
_NUMBER_WORD_STEMS = _words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand "
    "half halves third fourth quarter fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
    "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth thirtieth fortieth fiftieth "
    "sixtieth seventieth eightieth ninetieth hundredth thousandth dozen score gross grand thou lakh crore myriad "
    "mil mln bln squared cubed square cube cubic factorial inverse reciprocal root sqrt power exponent fold "
    "negative positive point mod modulo choose percentile"
)
# Multipliers and groups change it too: ``5 doubled`` is 10, ``5 twice`` 10, ``5 pairs`` 10 things.
_MULTIPLIER_STEMS = _words(
    "double doubled triple tripled quadruple quadrupled quintuple quintupled halve halved twice thrice pair "
    "couple brace duo trio quartet quintet sextet septet octet twin triplet quadruplet quintuplet"
)
NUMBER_WORDS = (
    _NUMBER_WORD_STEMS
    | _MULTIPLIER_STEMS
    | {w + "s" for w in _NUMBER_WORD_STEMS | _MULTIPLIER_STEMS}  # and their plurals
)
_ILLION = re.compile(r"[a-z]*illion(?:th)?s?")
# And by their form: a past participle names something done to the number (``5 increased``, ``5 divided``,
# ``5 rounded``), ``-fold`` and ``-uple`` words multiply it (``fivefold``, ``sextuple``). Nouns ending in "-ed"
# that a count may carry are kept: ``-eed`` words (seeds, speed) and these.
_CHANGING_FORM = re.compile(r"[a-z]*(?:[^e]ed|fold|uples?|uplets?)")
_NOUNS_ENDING_ED = _words("bed shed sled red bred")


@dataclass(frozen=True)
class WrittenNumber:
    """A number as written. ``decimals``: digits written after the point, less the decimal exponent
    (``2.50`` -> 2, ``1.5e3`` -> -2), or ``None`` for an exact form (an integer, ``a/b``); ``significant``:
    digits written from the first non-zero one (``0.0250`` -> 3)."""

    value: Fraction
    percent: bool = False
    decimals: int | None = None
    significant: int = 0


def frac_to_slash(s: str) -> str:
    """``\\frac{a}{b}`` (innermost only: ``[^{}]*`` cannot nest) becomes ``(a)/(b)``."""
    return FRAC.sub(lambda m: f"({m.group(1) or m.group(2)})/({m.group(3) or m.group(4)})", s)


def strip_latex(s: str) -> str:
    """Drop math delimiters, spacing commands, ``\\left``/``\\right`` and ``\\text{}`` wrappers."""
    s = s.strip().strip("$").strip()
    s = s.replace("\u2212", "-").replace("\\!", "").replace("\\,", ",").replace("\\ ", " ").replace("~", " ")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\%", "%").replace("\\$", "$")
    return _TEXT_WRAPPER.sub(r"\1", s).strip()


def parse_number(text: str) -> tuple[Fraction, bool] | None:
    """``(value, was_percent)`` for a written number, or ``None`` when it is not exactly one number.

    >>> parse_number("\\\\frac{3}{4}")[0], parse_number("1,234.5 cm")[0], parse_number("-25\\\\%")
    (Fraction(3, 4), Fraction(2469, 2), (Fraction(-25, 1), True))
    """
    number = read_number(text)
    return None if number is None else (number.value, number.percent)


def read_number(text) -> WrittenNumber | None:
    """The ``WrittenNumber`` a text states, or ``None`` when it is not exactly one number.

    Accepts ``\\frac{a}{b}``, ``a/b``, thousands separators (``1,234,567``, ``1\\,234``, ``1{,}234``,
    ``1 234``), ``$``, ``%``, a unicode minus, ``x = 5``, one trailing unit and scientific notation, within
    the module's bounds. Linear time in ``len(text)``; never raises; anything but a ``str`` is ``None``.
    """
    if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
        return None
    s = frac_to_slash(_ASSIGNMENT.sub("", strip_latex(text))).replace("{,}", ",").strip()
    s = s.lstrip("$").strip()
    if s.startswith("-$"):
        s = "-" + s[2:]
    percent = s.endswith("%")
    s = s.rstrip("%").strip().rstrip(".")
    unit = _WITH_UNIT.match(s)
    if unit and _is_unit(unit.group(3), spaced=bool(unit.group(2))):
        s = unit.group(1)
    number = _parse_value(s)
    return None if number is None else WrittenNumber(number.value, percent, number.decimals, number.significant)


def _is_unit(word: str | None, spaced: bool) -> bool:
    if word is None:  # a degree sign
        return True
    if word in _UNIT_SYMBOLS:
        return True
    lowered = word.lower()
    return (
        spaced
        and len(word) >= 3
        and lowered not in NOT_UNITS
        and lowered not in NUMBER_WORDS
        and not _ILLION.fullmatch(lowered)
        and not (_CHANGING_FORM.fullmatch(lowered) and lowered not in _NOUNS_ENDING_ED)
    )


def _closing(s: str) -> int:
    """Index of the bracket that closes ``s[0]`` (``(`` or ``{``), or -1."""
    depth = 0
    for i, ch in enumerate(s):
        depth += 1 if ch in "({" else -1 if ch in ")}" else 0
        if depth == 0:
            return i
    return -1


def _unwrap(s: str) -> tuple[bool, str]:
    """``(negated, core)``: signs and brackets that wrap the WHOLE of ``s`` removed; inner ones stay."""
    negated = False
    for _ in range(MAX_ANSWER_CHARS):  # each pass removes at least one character
        s = s.strip()
        if s[:1] in ("-", "+") and s[1:].lstrip()[:1] in ("(", "{"):
            negated ^= s[0] == "-"
            s = s[1:].lstrip()
        if s[:1] in ("(", "{") and _closing(s) == len(s) - 1:
            s = s[1:-1]
        else:
            break
    return negated, s


def _parse_value(s: str) -> WrittenNumber | None:
    """``m``, ``m \\times 10^e`` or ``a/b`` with plain decimals ``m``, ``a``, ``b``; no recursion."""
    negated, s = _unwrap(s)
    times_ten = _TIMES_TEN.search(s)
    if times_ten:
        mantissa_negated, mantissa_text = _unwrap(s[: times_ten.start()])
        mantissa = _parse_decimal(mantissa_text)
        exponent = int(times_ten.group(1) or times_ten.group(2))
        if mantissa is None or abs(exponent) > MAX_EXPONENT:
            return None
        value = mantissa.value * Fraction(10) ** exponent * (-1 if mantissa_negated else 1)
        decimals = None if mantissa.decimals is None else mantissa.decimals - exponent
        number = WrittenNumber(value, False, decimals, mantissa.significant)
    elif "/" in s:
        num, _, den = s.partition("/")
        if "/" in den:
            return None  # "1/2/3" is ambiguous, not one number
        (num_neg, num_s), (den_neg, den_s) = _unwrap(num), _unwrap(den)
        num_v, den_v = _parse_decimal(num_s), _parse_decimal(den_s)
        if num_v is None or den_v is None or not den_v.value:
            return None
        value = num_v.value / den_v.value * (-1 if num_neg != den_neg else 1)
        number = WrittenNumber(value, False, None, 0)
    else:
        number = _parse_decimal(s)
    if number is None:
        return None
    return WrittenNumber(-number.value, False, number.decimals, number.significant) if negated else number


def _parse_decimal(s: str) -> WrittenNumber | None:
    """``[-+]digits[.digits][e[-+]digits]`` with optional thousands separators, within the bounds."""
    if s[:1] in "-+" and s[1:2] == " ":
        s = s[0] + s[1:].lstrip()
    if _SPACED_THOUSANDS.match(s):
        s = s.replace(" ", "")
    elif _COMMA_THOUSANDS.match(s):
        s = s.replace(",", "")
    match = _DECIMAL.match(s)
    if not match:
        return None
    sign, whole, point, frac, exp = match.groups(default="")
    digits = whole + frac
    if not digits or len(digits) > MAX_DIGITS:
        return None
    exponent = int(exp or 0)
    if abs(exponent) > MAX_EXPONENT:
        return None
    value = Fraction(int(digits)) * Fraction(10) ** (exponent - len(frac))
    decimals = len(frac) - exponent if frac else None  # "5" and "5." are exact; "5.0" is written to 0.1
    significant = len(digits.lstrip("0"))
    return WrittenNumber(-value if sign == "-" else value, False, decimals, significant)
