"""Final-answer extraction and numeric-aware comparison for math rewards (ReTool, GSM8K).

Numbers are compared exactly as ``fractions.Fraction`` (with a 1e-6 relative tolerance for decimals that
approximate a fraction), after normalising the ways a model writes them: ``\\boxed{}``, ``\\frac{a}{b}``,
``a/b``, thousands separators (``1,234,567``, ``1\\,234``), ``$``/``\\$``, percentages, unicode minus,
trailing units (``12 cm``, ``12\\text{ apples}``, ``90^\\circ``) and scientific notation.
"""

from __future__ import annotations

import re
from fractions import Fraction

_HARMONY_FINAL = "<|channel|>final<|message|>"
_HARMONY_END = re.compile(r"<\|(?:return|end|call)\|>\s*$")
_GSM8K_MARK = re.compile(r"####\s*(.+)")
_ANSWER_PHRASE = re.compile(r"(?:final answer|answer)\s*(?:is|:|=)\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\s*(?:\{([^{}]*)\}|(\d))\s*(?:\{([^{}]*)\}|(\d))")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*\s*=\s*")  # "x = 5" states 5
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_PLAIN = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?$", re.IGNORECASE)
_TIMES_TEN = re.compile(r"^(.+?)\s*(?:\\times|\\cdot|x|\*)\s*10\s*\^\s*\{?\s*(-?\d+)\s*\}?$")
_UNIT_TAIL = re.compile(r"^(-?[\d.,/]+(?:e[-+]?\d+)?)\s*(?:\^\s*\{?\\circ\}?|°|[a-zA-Z][a-zA-Z .]*)$")


def completion_text(completion) -> str:
    """The text of a completion: a string, or TRL's conversational ``[{"role", "content"}, ...]``.

    For a message list, the last assistant message's content (string or list of ``{"type": "text"}``
    parts). Raw Harmony text keeps only the last ``final`` channel message.
    """
    if isinstance(completion, list):
        assistant = [
            m for m in completion if isinstance(m, dict) and m.get("role", "assistant") == "assistant"
        ]
        content = assistant[-1].get("content", "") if assistant else ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        completion = content or ""
    if not isinstance(completion, str):
        raise ValueError(
            f"A completion must be a str or a list of messages, got {type(completion).__name__}."
        )
    if _HARMONY_FINAL in completion:
        completion = _HARMONY_END.sub("", completion.rsplit(_HARMONY_FINAL, 1)[1])
    return completion


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces, or ``None``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1 : i].strip()
    return None


def extract_final_answer(text: str, fallback_to_last_number: bool = True) -> str | None:
    """The model's final answer: last ``\\boxed{}``, else ``#### x``, else "answer is x", else last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (_GSM8K_MARK, _ANSWER_PHRASE):
        matches = pattern.findall(text)
        if matches:
            return matches[-1].strip().splitlines()[0].strip().rstrip(".")
    if fallback_to_last_number:
        numbers = _NUMBER.findall(text.replace("\u2212", "-"))
        if numbers:
            return numbers[-1]
    return None


def _strip_latex(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = s.replace("\u2212", "-").replace("\\!", "").replace("\\,", ",").replace("\\ ", " ").replace("~", " ")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\%", "%").replace("\\$", "$")
    s = _TEXT_WRAPPER.sub(r"\1", s)
    return s.strip()


def parse_number(text: str) -> tuple[Fraction, bool] | None:
    """``(value, was_percent)`` for a written number, or ``None`` when it is not one number.

    >>> parse_number("\\\\frac{3}{4}")[0], parse_number("1,234.5 cm")[0], parse_number("-25\\\\%")
    (Fraction(3, 4), Fraction(2469, 2), (Fraction(-25, 1), True))
    """
    s = _ASSIGNMENT.sub("", _strip_latex(text))
    s = _FRAC.sub(lambda m: f"({m.group(1) or m.group(2)})/({m.group(3) or m.group(4)})", s)
    s = s.replace("(", "").replace(")", "").replace("{", "").replace("}", "").strip()
    s = s.lstrip("$").strip()
    if s.startswith("-$"):
        s = "-" + s[2:]
    percent = s.endswith("%")
    s = s.rstrip("%").strip().rstrip(".")
    unit = _UNIT_TAIL.match(s)
    if unit:
        s = unit.group(1)
    value = _parse_plain(s)
    return None if value is None else (value, percent)


def _parse_plain(s: str) -> Fraction | None:
    times_ten = _TIMES_TEN.match(s)
    if times_ten:
        mantissa = _parse_plain(times_ten.group(1))
        return None if mantissa is None else mantissa * Fraction(10) ** int(times_ten.group(2))
    if "/" in s:
        num, _, den = s.partition("/")
        num_v, den_v = _parse_plain(num.strip()), _parse_plain(den.strip())
        return None if num_v is None or not den_v else num_v / den_v
    s = s.replace(" ", "")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if not _PLAIN.match(s):
        return None
    return Fraction(s)


def _normalise_text(s: str) -> str:
    """Symbolic answers compare as text: ``\\frac{\\pi}{2}`` and ``\\pi/2`` both become ``\\pi/2``."""
    s = _FRAC.sub(lambda m: f"({m.group(1) or m.group(2)})/({m.group(3) or m.group(4)})", _strip_latex(s))
    return re.sub(r"[\s{}()]", "", s).rstrip(".").lower()


def answers_match(prediction: str | None, truth: str, rel_tol: float = 1e-6) -> bool:
    """True when ``prediction`` states the same answer as ``truth`` (numbers by value, else text).

    A percentage matches its number (``50%`` vs ``50``) and, when only one side wrote ``%``, also its
    fraction (``50%`` vs ``0.5``).
    """
    if prediction is None:
        return False
    pred_num, true_num = parse_number(prediction), parse_number(truth)
    if pred_num is None or true_num is None:
        return _normalise_text(prediction) == _normalise_text(truth)
    (p, p_pct), (t, t_pct) = pred_num, true_num
    candidates = [p]
    if p_pct != t_pct:
        candidates.append(p / 100 if p_pct else p * 100)
    return any(_close(c, t, rel_tol) for c in candidates)


def _close(a: Fraction, b: Fraction, rel_tol: float) -> bool:
    if a == b:
        return True
    return abs(a - b) <= rel_tol * max(abs(a), abs(b))
