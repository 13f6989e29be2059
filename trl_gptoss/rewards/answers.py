"""Final-answer extraction and exact comparison for math rewards (ReTool, GSM8K).

The contract (see docs/tools_and_rewards.md, "Rewards' contract"): every function here takes any string,
returns in time linear in its length, never raises for a completion, and errs towards a false negative,
never a false positive.

- **The final message only.** Raw Harmony text is scored from the last ``final`` channel message's body
  up to its stop token; Harmony text without a final message has no answer.
- **Marked answers only.** The answers are the outermost ``\\boxed{}``/``\\fbox{}``, else the values after
  each ``####``, else the value after each "answer is" / "Answer:" / "answer =". A rewarded
  completion must state the truth in EVERY box (every ``####``, every "answer is"): ``\\boxed{3} or
  \\boxed{4}`` lists guesses. A box that only wraps a box is its content (``\\boxed{\\boxed{4}}`` is
  ``4``); a box inside other text is part of that text (``\\boxed{3 + \\boxed{4}}`` is ``3 + \\boxed{4}``).
  A marker with nothing after it, an unclosed box or one longer than ``MAX_ANSWER_CHARS`` gives no answer.
  There is no "last number in the text" fallback in the rewards; ``extract_final_answer`` offers one for evaluation.
- **One value.** A numeric truth needs one number: ``3, 4``, ``3 or 4``, ``1170 not``, ``2(3)`` are not.
- **Exact numbers, precision as written.** Numbers compare as ``Fraction``. The one approximation allowed:
  a written decimal (a point with digits after it) of at least ``min_digits`` significant digits stands for
  a value whose decimal expansion does not terminate when it is that value rounded to nearest, or toward
  zero, at the decimal's own written precision (``0.3333333`` and ``333333.7`` for ``1/3`` and
  ``1000001/3``; not ``333333.5``, ``0.33`` or an integer).
- **Symbolic answers compare by structure** (``structure.py``); prose answers (words only, one of 3+
  letters) compare case-insensitively.
"""

from __future__ import annotations

import re
from collections import deque
from fractions import Fraction

from trl_gptoss.rewards.numbers import MAX_ANSWER_CHARS, WrittenNumber, read_number, strip_latex
from trl_gptoss.rewards.structure import same_structure

MIN_DIGITS = 6
MAX_DISTINCT_ANSWERS = 4  # more distinct marked answers than this is a list of guesses: no answer
_FINAL_HEADER = re.compile(r"<\|channel\|>final(?![\w-])[^<>\n]{0,200}(?:<\|constrain\|>[^<>\n]{0,200})?<\|message\|>")
_HARMONY_TOKEN = re.compile(
    r"<\|(?:start|end|message|channel|constrain|call|return|endoftext|startoftext|reserved_\d+)\|>"
)
_HEADER_TOKENS = ("<|channel|>", "<|message|>")
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BOX_GAP = 8  # spaces or tabs allowed between \boxed and its brace
_GSM8K_MARK = "####"
_BLANK = re.compile(r"\s*")
_ANSWER_PHRASE = re.compile(r"answer[ \t]*(?:is\b[ \t]*:?|:|=)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_PROSE = re.compile(r"[A-Za-z]+(?:[ '\-]+[A-Za-z]+)*")
_LONG_WORD = re.compile(r"[A-Za-z]{3}")


def completion_text(completion) -> str:
    """The scored text of a completion: a string, or TRL's conversational ``[{"role", "content"}, ...]``.

    For a message list, the last assistant message's content (string or list of ``{"type": "text"}``
    parts; other parts are skipped); ``None`` is ``""``. In Harmony text only the body of the last
    ``final`` channel message counts, up to the next Harmony token (``<|end|>``, ``<|return|>``, ...); text
    with Harmony headers but no final message scores ``""``; text without headers is cut at its first
    Harmony token (a final message prefilled by the prompt). Raises ``ValueError`` only for a value that
    is neither (a programming error, not a completion).
    """
    if completion is None:
        return ""
    if isinstance(completion, list):
        assistant = [m for m in completion if isinstance(m, dict) and m.get("role", "assistant") == "assistant"]
        content = assistant[-1].get("content", "") if assistant else ""
        if isinstance(content, list):
            content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        completion = content if isinstance(content, str) else ""
    if not isinstance(completion, str):
        raise ValueError(f"A completion must be a str or a list of messages, got {type(completion).__name__}.")
    last_final = deque(_FINAL_HEADER.finditer(completion), maxlen=1)
    if last_final:
        start = last_final[0].end()
    elif any(token in completion for token in _HEADER_TOKENS):
        return ""  # Harmony messages, none of them final: analysis and tool output are not answers
    else:
        start = 0
    stop = _HARMONY_TOKEN.search(completion, start)
    return completion[start : stop.start() if stop else len(completion)]


def _box_at(text: str, index: int) -> tuple[str | None, int]:
    """``(content, end)`` of the box whose command ends at ``index``; content ``None`` when unclosed or
    longer than ``MAX_ANSWER_CHARS``; ``("", -1)`` when no brace follows (not a box)."""
    gap = text[index : index + _BOX_GAP]
    brace = index + len(gap) - len(gap.lstrip(" \t"))
    if not text.startswith("{", brace):
        return "", -1
    body = text[brace : brace + MAX_ANSWER_CHARS + 2]  # "{", at most MAX_ANSWER_CHARS of content, "}"
    depth = 0
    for i, ch in enumerate(body):
        depth += 1 if ch == "{" else -1 if ch == "}" else 0
        if depth == 0:
            return body[1:i].strip(), brace + i + 1
    return None, len(text)


def _unbox(content: str) -> str:
    """``\\boxed{\\boxed{4}}`` states ``4``: strip the boxes that wrap the whole content. One pass pairs
    the braces, so peeling many layers stays linear."""
    closing, stack = {}, []
    for i, ch in enumerate(content):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closing[stack.pop()] = i
    start, end = 0, len(content)
    while match := _BOX.match(content, start, end):
        gap = content[match.end() : match.end() + _BOX_GAP]
        brace = match.end() + len(gap) - len(gap.lstrip(" \t"))
        if closing.get(brace) != end - 1:
            break
        start, end = brace + 1, end - 1
        while start < end and content[start].isspace():
            start += 1
        while end > start and content[end - 1].isspace():
            end -= 1
    return content[start:end]


def boxed_answers(text: str) -> list[str] | None:
    """Contents of the outermost boxes in order (``[]`` without one); ``None`` when a box is unclosed or
    longer than ``MAX_ANSWER_CHARS`` (the rest of the text is inside it). Each character is read once."""
    answers, resume = [], 0
    for match in _BOX.finditer(text):
        if match.start() < resume:
            continue  # inside the previous box
        content, end = _box_at(text, match.end())
        if content is None:
            return None
        if end >= 0:
            answers.append(_unbox(content))
            resume = end
    return answers


def last_boxed(text: str) -> str | None:
    """Content of the last outermost ``\\boxed{...}`` / ``\\fbox{...}``, or ``None`` (see ``boxed_answers``)."""
    answers = boxed_answers(text)
    return answers[-1] if answers else None


def _value_after(text: str, index: int, end: int | None = None) -> str | None:
    """The first non-blank line after ``index`` (bounded read, and not past ``end``), without a final ``.``;
    ``None`` if empty."""
    start = _BLANK.match(text, index).end()
    stop = start + MAX_ANSWER_CHARS + 1 if end is None else min(end, start + MAX_ANSWER_CHARS + 1)
    line = text[start:stop].split("\n", 1)[0].strip().rstrip(".").strip()
    return line or None


def marked_answers(text: str) -> list[str | None]:
    """Every marked answer of the first kind present: the outermost boxes, else the value after each
    ``####``, else the value after each "answer is" (``None`` for a marker with nothing after it). A reward
    needs them all to agree: ``The answer is 5. The answer is 6.`` lists two answers, as two ``####`` do (a
    self-correction must leave one answer; a reward cannot tell it from a hedge)."""
    boxes = boxed_answers(text)
    if boxes:
        return boxes
    marks = [_value_after(text, m.end()) for m in re.finditer(_GSM8K_MARK, text)]
    if marks:
        return marks
    phrases = list(_ANSWER_PHRASE.finditer(text))
    ends = [m.start() for m in phrases[1:]] + [None]  # a value ends where the next marker starts
    return [_value_after(text, m.end(), end) for m, end in zip(phrases, ends)]


def _lone_number_on_last_line(text: str) -> str | None:
    stripped = text.rstrip()
    last_line = stripped[stripped.rfind("\n") + 1 :]
    if len(last_line) > MAX_ANSWER_CHARS:
        return None
    numbers = _NUMBER.findall(last_line.replace("\u2212", "-"))
    return numbers[0] if len(numbers) == 1 else None


def extract_final_answer(text: str, fallback_to_last_number: bool = False) -> str | None:
    """The completion's last marked answer (see ``marked_answers``), or ``None``.

    ``fallback_to_last_number=True`` (evaluation only; no reward uses it) then accepts a last line that
    holds exactly one number.
    """
    answers = marked_answers(text)
    answer = answers[-1] if answers else None
    if answer is None and fallback_to_last_number:
        answer = _lone_number_on_last_line(text)
    return answer


def all_answers_match(answers: list[str | None], truth, min_digits: int = MIN_DIGITS) -> bool:
    """True when there is at least one answer, at most ``MAX_DISTINCT_ANSWERS`` distinct ones, and every
    one matches ``truth``."""
    distinct = list(dict.fromkeys(answers))
    if not distinct or len(distinct) > MAX_DISTINCT_ANSWERS:
        return False
    return all(answers_match(answer, truth, min_digits) for answer in distinct)


def _prose(s: str) -> str | None:
    """A words-only answer with a word of 3+ letters, lowercased and single-spaced (``Paris.`` -> ``paris``)."""
    s = strip_latex(s).rstrip(".").strip()
    if not _PROSE.fullmatch(s) or not _LONG_WORD.search(s):
        return None
    return " ".join(s.lower().split())


def answers_match(prediction, truth, min_digits: int = MIN_DIGITS) -> bool:
    """True when ``prediction`` states the same answer as ``truth`` (module docstring for the rules).

    A numeric truth needs a prediction that is one number of the same value (``_numbers_agree``); a prose
    truth a prediction with the same words in any case; any other truth the same structure. A percentage
    matches its number (``50%`` vs ``50``) and, when only one side wrote ``%``, also its fraction (``50%``
    vs ``0.5``). ``None``, a non-string, an empty prediction, or one longer than ``MAX_ANSWER_CHARS``
    never matches. Linear time in the lengths of both strings.
    """
    if not isinstance(prediction, str) or not isinstance(truth, str):
        return False
    prediction, truth = prediction.strip(), truth.strip()
    if not prediction or not truth or len(prediction) > MAX_ANSWER_CHARS or len(truth) > MAX_ANSWER_CHARS:
        return False
    true_number = read_number(truth)
    if true_number is not None:
        predicted = read_number(prediction)
        return predicted is not None and _numbers_agree(predicted, true_number, min_digits)
    prose = _prose(truth)
    if prose is not None:
        return _prose(prediction) == prose
    return same_structure(prediction, truth)


def _numbers_agree(p: WrittenNumber, t: WrittenNumber, min_digits: int) -> bool:
    candidates = [p]
    if p.percent != t.percent:  # 50% is 0.5: the value moves two places, and so does its precision
        shift = 2 if p.percent else -2
        decimals = None if p.decimals is None else p.decimals + shift
        candidates.append(
            WrittenNumber(p.value / 100 if p.percent else p.value * 100, t.percent, decimals, p.significant)
        )
    return any(_agree(c, t, min_digits) for c in candidates)


def _terminates(x: Fraction) -> bool:
    """Whether ``x`` has a finite decimal expansion (its denominator is ``2**i * 5**j``)."""
    d = x.denominator
    d >>= (d & -d).bit_length() - 1  # drop the factors of 2
    while d % 5 == 0:
        d //= 5
    return d == 1


def _agree(a: WrittenNumber, b: WrittenNumber, min_digits: int) -> bool:
    """Equal values; or one side a decimal of ``min_digits``+ significant digits that is the other side's
    non-terminating exact value rounded to nearest or toward zero at the decimal's written precision."""
    if a.value == b.value:
        return True
    if (a.decimals is None) == (b.decimals is None):
        return False  # two exact forms, or two decimals, compare exactly
    written, exact = (a, b) if a.decimals is not None else (b, a)
    if _terminates(exact.value) or written.significant < min_digits:
        return False
    scale = Fraction(10) ** written.decimals
    scaled = exact.value * scale
    return written.value in (Fraction(round(scaled)) / scale, Fraction(int(scaled)) / scale)
