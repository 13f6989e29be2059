"""Bounded parsing of one written number into an exact ``Fraction``.

Model output is untrusted, so every step is linear in the answer's length and no step builds a huge value:

- an answer longer than ``MAX_ANSWER_CHARS`` characters is not a number;
- a mantissa has at most ``MAX_DIGITS`` digits (Python refuses ``int()`` of more than 4300 digits, and
  far smaller answers are all a math task ever has);
- a decimal exponent (``2.5e-3``, ``1.5 \\times 10^{3}``) has ``|e| <= MAX_EXPONENT`` (``10**e`` for
  ``e = 10**8`` takes minutes);
- at most one ``/`` and one ``\\times 10^{e}``: parsing never recurses, so nesting cannot overflow the stack.

Anything beyond these bounds is "not a number" (``None``); the caller then compares the answer as text.
So the largest value ever built is below ``10**(2 * (MAX_DIGITS + 2 * MAX_EXPONENT))``: microseconds.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_ANSWER_CHARS = 400
MAX_DIGITS = 300
MAX_EXPONENT = 400

FRAC = re.compile(r"\\[dt]?frac\s*(?:\{([^{}]*)\}|(\d))\s*(?:\{([^{}]*)\}|(\d))")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w{0,20}\s*=\s*")  # "x = 5" states 5
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACED_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?: \d{3})+(?:\.\d+)?$")
_COMMA_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL = re.compile(r"^([-+]?)(\d*)(?:\.(\d*))?(?:[eE]([-+]?\d{1,6}))?$")
_TIMES_TEN = re.compile(r"(?:\\times|\\cdot|\*|x)\s*10\s*\^\s*([-+]?\d{1,6})$")
# A unit is ONE word (optionally "square"/"cubic" before it, a power or "/word" after it) or a degree
# sign. "12 cm", "5 apples", "3 m/s", "90^\circ" state a number; "1170 is wrong" does not.
_WITH_UNIT = re.compile(
    r"^([-+]?[\d.,/]+(?:[eE][-+]?\d+)?)\s*"
    r"(?:\^\s*\\circ|°|(?:(?:square|sq\.?|cubic)\s+)?[A-Za-z]{1,20}\.?(?:\^\s*[23]|/[A-Za-z]{1,10})?)$"
)


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

    Accepts ``\\frac{a}{b}``, ``a/b``, thousands separators (``1,234,567``, ``1\\,234``, ``1 234``), ``$``,
    ``%``, a unicode minus, ``x = 5``, one trailing unit word and scientific notation, within the module's
    bounds. Linear time in ``len(text)``; never raises for a string.

    >>> parse_number("\\\\frac{3}{4}")[0], parse_number("1,234.5 cm")[0], parse_number("-25\\\\%")
    (Fraction(3, 4), Fraction(2469, 2), (Fraction(-25, 1), True))
    """
    if len(text) > MAX_ANSWER_CHARS:
        return None
    s = _ASSIGNMENT.sub("", strip_latex(text))
    s = frac_to_slash(s)
    s = s.replace("(", "").replace(")", "").replace("{", "").replace("}", "").strip()
    s = s.lstrip("$").strip()
    if s.startswith("-$"):
        s = "-" + s[2:]
    percent = s.endswith("%")
    s = s.rstrip("%").strip().rstrip(".")
    unit = _WITH_UNIT.match(s)
    if unit:
        s = unit.group(1)
    value = _parse_value(s)
    return None if value is None else (value, percent)


def _parse_value(s: str) -> Fraction | None:
    """``m``, ``m \\times 10^e`` or ``a/b`` with plain decimals ``m``, ``a``, ``b``; no recursion."""
    times_ten = _TIMES_TEN.search(s)
    if times_ten:
        mantissa = _parse_decimal(s[: times_ten.start()].strip())
        exponent = int(times_ten.group(1))
        if mantissa is None or abs(exponent) > MAX_EXPONENT:
            return None
        return mantissa * Fraction(10) ** exponent
    num, slash, den = s.partition("/")
    if not slash:
        return _parse_decimal(s)
    if "/" in den:
        return None  # "1/2/3" is ambiguous, not one number
    num_v, den_v = _parse_decimal(num.strip()), _parse_decimal(den.strip())
    return None if num_v is None or not den_v else num_v / den_v


def _parse_decimal(s: str) -> Fraction | None:
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
    sign, whole, frac, exp = match.groups(default="")
    digits = whole + frac
    if not digits or len(digits) > MAX_DIGITS:
        return None
    if abs(int(exp or 0)) > MAX_EXPONENT:
        return None
    value = Fraction(int(digits)) * Fraction(10) ** (int(exp or 0) - len(frac))
    return -value if sign == "-" else value
