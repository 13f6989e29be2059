"""Final-answer extraction and exact comparison for math rewards (ReTool, GSM8K).

The contract (see docs/tools_and_rewards.md, "Rewards' contract"): every function here takes any string,
returns in time linear in its length, and never raises for a completion.

- **Marked answers only.** The answer is the last ``\\boxed{}``/``\\fbox{}``, else the value after the
  last ``####``, else after the last "answer is" / "Answer:" / "answer =". Only the last marker of a
  kind counts; a marker with nothing after it (a truncated completion) gives no answer. A last box that
  is unbalanced or longer than ``MAX_ANSWER_CHARS`` gives no answer. There is no "last number in the
  text" fallback in the rewards: it would pay a completion that lists guesses. ``extract_final_answer``
  offers one for evaluation only, and only when the last line holds exactly one number.
- **One value.** The marked answer must be one number (or one symbolic expression): ``3, 4, 5``,
  ``3 or 4``, ``1170 is wrong`` are not numbers and never match a numeric truth.
- **Exact numbers.** Numbers compare as ``Fraction``. Integers and finite decimals compare exactly; the
  only tolerance (relative ``1e-6``) lets a written decimal approximate a value whose decimal expansion
  does not terminate (``0.3333333`` for ``1/3``). ``123456790`` never matches ``123456789``.
"""

from __future__ import annotations

import re
from collections import deque
from fractions import Fraction

from trl_gptoss.rewards.numbers import MAX_ANSWER_CHARS, frac_to_slash, parse_number, strip_latex

_HARMONY_FINAL = "<|channel|>final<|message|>"
_HARMONY_STOPS = ("<|return|>", "<|end|>", "<|call|>")
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BOX_GAP = 8  # spaces or tabs allowed between \boxed and its brace
_GSM8K_MARK = "####"
_ANSWER_PHRASE = re.compile(r"answer[ \t]*(?:is\b[ \t]*:?|:|=)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_TEXT_NOISE = re.compile(r"[\s{}()]")


def completion_text(completion) -> str:
    """The text of a completion: a string, or TRL's conversational ``[{"role", "content"}, ...]``.

    For a message list, the last assistant message's content (string or list of ``{"type": "text"}``
    parts; other parts are skipped). Raw Harmony text keeps only the last ``final`` channel message.
    Raises ``ValueError`` only for a value that is neither (a programming error, not a completion).
    """
    if isinstance(completion, list):
        assistant = [m for m in completion if isinstance(m, dict) and m.get("role", "assistant") == "assistant"]
        content = assistant[-1].get("content", "") if assistant else ""
        if isinstance(content, list):
            content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        completion = content if isinstance(content, str) else ""
    if not isinstance(completion, str):
        raise ValueError(f"A completion must be a str or a list of messages, got {type(completion).__name__}.")
    if _HARMONY_FINAL in completion:
        completion = completion.rsplit(_HARMONY_FINAL, 1)[1].rstrip()
        for stop in _HARMONY_STOPS:
            if completion.endswith(stop):
                completion = completion[: -len(stop)]
                break
    return completion


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}``, or ``None``.

    ``None`` also when that last box is unbalanced (truncated) or its content is longer than
    ``MAX_ANSWER_CHARS``: the scan never reads more than that many characters past the brace.
    """
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    gap = text[start + len(command) : start + len(command) + _BOX_GAP]
    brace = start + len(command) + len(gap) - len(gap.lstrip(" \t"))
    if not text.startswith("{", brace):
        return None
    body = text[brace : brace + MAX_ANSWER_CHARS + 2]  # "{", at most MAX_ANSWER_CHARS of content, "}"
    depth = 0
    for i, ch in enumerate(body):
        depth += 1 if ch == "{" else -1 if ch == "}" else 0
        if depth == 0:
            return body[1:i].strip()
    return None


def _value_after(text: str, index: int) -> str | None:
    """The first non-blank line after ``index`` (bounded read), without a final ``.``; ``None`` if empty."""
    rest = text[index:].lstrip()
    line = rest[: MAX_ANSWER_CHARS + 1].split("\n", 1)[0].strip().rstrip(".").strip()
    return line or None


def _after_last_answer_phrase(text: str) -> str | None:
    last = deque(_ANSWER_PHRASE.finditer(text), maxlen=1)  # only the last match is kept
    return _value_after(text, last[0].end()) if last else None


def _lone_number_on_last_line(text: str) -> str | None:
    stripped = text.rstrip()
    last_line = stripped[stripped.rfind("\n") + 1 :]
    if len(last_line) > MAX_ANSWER_CHARS:
        return None
    numbers = _NUMBER.findall(last_line.replace("\u2212", "-"))
    return numbers[0] if len(numbers) == 1 else None


def extract_final_answer(text: str, fallback_to_last_number: bool = False) -> str | None:
    """The completion's marked final answer (see the module docstring for the policy), or ``None``.

    Last ``\\boxed{}``, else the value after the last ``####``, else after the last "answer is"/"Answer:".
    ``fallback_to_last_number=True`` (evaluation only; no reward uses it) then accepts a last line that
    holds exactly one number.
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    mark = text.rfind(_GSM8K_MARK)
    answer = _value_after(text, mark + len(_GSM8K_MARK)) if mark >= 0 else None
    answer = answer or _after_last_answer_phrase(text)
    if answer is None and fallback_to_last_number:
        answer = _lone_number_on_last_line(text)
    return answer


def _normalise_text(s: str) -> str:
    """Symbolic answers compare as text: ``\\frac{\\pi}{2}`` and ``\\pi/2`` both become ``\\pi/2``."""
    return _TEXT_NOISE.sub("", frac_to_slash(strip_latex(s))).rstrip(".").lower()


def answers_match(prediction: str | None, truth: str, rel_tol: float = 1e-6) -> bool:
    """True when ``prediction`` states the same answer as ``truth``.

    A numeric truth needs a prediction that parses as one number of the same value (see ``_close``); any
    other truth compares as normalised text (LaTeX wrappers, spaces, braces and case dropped).

    A percentage matches its number (``50%`` vs ``50``) and, when only one side wrote ``%``, also its
    fraction (``50%`` vs ``0.5``). An empty prediction, or one longer than ``MAX_ANSWER_CHARS``, never
    matches. Linear time in the lengths of both strings.
    """
    if prediction is None:
        return False
    prediction = prediction.strip()
    if not prediction or len(prediction) > MAX_ANSWER_CHARS:
        return False
    pred_num, true_num = parse_number(prediction), parse_number(truth)
    if true_num is None:  # a symbolic truth compares as normalised text
        return _normalise_text(prediction) == _normalise_text(truth)
    if pred_num is None:  # a numeric truth needs one number: "1 2 3" is not 123 even though its text is
        return False
    (p, p_pct), (t, t_pct) = pred_num, true_num
    candidates = [p]
    if p_pct != t_pct:
        candidates.append(p / 100 if p_pct else p * 100)
    tolerance = Fraction(str(rel_tol))
    return any(_close(c, t, tolerance) for c in candidates)


def _terminates(x: Fraction) -> bool:
    """Whether ``x`` has a finite decimal expansion (its denominator is ``2**i * 5**j``)."""
    d = x.denominator
    d >>= (d & -d).bit_length() - 1  # drop the factors of 2
    while d % 5 == 0:
        d //= 5
    return d == 1


def _close(a: Fraction, b: Fraction, rel_tol: Fraction) -> bool:
    """Exact, except a non-integer finite decimal may approximate a non-terminating value to ``rel_tol``."""
    if a == b:
        return True
    a_ends, b_ends = _terminates(a), _terminates(b)
    if a_ends == b_ends:
        return False
    written = a if a_ends else b
    if written.denominator == 1:
        return False  # integers are exact: 333333333 is not 10**9 / 3
    return abs(a - b) <= rel_tol * max(abs(a), abs(b))
