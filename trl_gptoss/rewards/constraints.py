"""VerifyIf constraint checkers: one rule-based verifier per kind of instruction-following constraint.

A constraint is a dict ``{"type": KIND, **params}``; ``CHECKERS[KIND](text, **params) -> bool``.
Counts accept ``min``/``max`` bounds (inclusive) or ``exactly``. ``check_constraint`` validates the
parameters and raises ``ValueError`` naming what to change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

_WORD = re.compile(r"\b[\w'-]+\b", re.UNICODE)
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
_BULLET = re.compile(r"^\s*[*\-+•]\s+\S", re.MULTILINE)
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+\S", re.MULTILINE)
_HIGHLIGHT = re.compile(r"\*[^\n*]+\*")
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]+\]")
_TITLE = re.compile(r"<<[^<>\n]+>>")
_FENCE = re.compile(r"^\s*```(?:json|JSON)?\s*\n(.*)\n\s*```\s*$", re.DOTALL)


def _within(count: int, min=None, max=None, exactly=None) -> bool:
    if exactly is not None:
        return count == exactly
    return (min is None or count >= min) and (max is None or count <= max)


def word_count(text: str, **bounds) -> bool:
    """Number of words (``\\w``, apostrophes and hyphens inside words) within the bounds."""
    return _within(len(_WORD.findall(text)), **bounds)


def sentence_count(text: str, **bounds) -> bool:
    """Sentences: runs ending in ``.``, ``!`` or ``?`` followed by space/end, plus an unterminated tail."""
    stripped = text.strip()
    ends = len(_SENTENCE_END.findall(stripped))
    tail = 1 if stripped and not _SENTENCE_END.search(stripped[-3:] + " ") else 0
    return _within(ends + tail, **bounds)


def paragraph_count(text: str, **bounds) -> bool:
    """Paragraphs are separated by blank lines (or IFEval's ``***`` divider lines)."""
    blocks = re.split(r"\n\s*\n|\n\s*\*\*\*\s*\n", text.strip())
    return _within(len([b for b in blocks if b.strip()]), **bounds)


def _keyword_pattern(keyword: str) -> re.Pattern:
    return re.compile(rf"(?<!\w){re.escape(keyword)}(?!\w)", re.IGNORECASE)


def keywords_present(text: str, keywords: list[str]) -> bool:
    """Every keyword appears as a whole word/phrase (case-insensitive)."""
    return all(_keyword_pattern(k).search(text) for k in keywords)


def keywords_forbidden(text: str, keywords: list[str]) -> bool:
    """No keyword appears as a whole word/phrase (case-insensitive): ``cat`` does not forbid ``category``."""
    return not any(_keyword_pattern(k).search(text) for k in keywords)


def keyword_frequency(text: str, keyword: str, **bounds) -> bool:
    return _within(len(_keyword_pattern(keyword).findall(text)), **bounds)


def letter_frequency(text: str, letter: str, **bounds) -> bool:
    """Occurrences of one letter, case-insensitive."""
    if len(letter) != 1:
        raise ValueError(f"letter_frequency: 'letter' must be one character, got {letter!r}.")
    return _within(text.lower().count(letter.lower()), **bounds)


def json_format(text: str) -> bool:
    """The whole response is valid JSON (a surrounding ```json fence is allowed)."""
    fenced = _FENCE.match(text)
    try:
        json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError:
        return False
    return True


def markdown_headings(text: str, **bounds) -> bool:
    """Markdown ATX headings (``# Title``) within the bounds."""
    return _within(len(_HEADING.findall(text)), **bounds)


def bullet_count(text: str, **bounds) -> bool:
    """Markdown bullet items (``*``, ``-``, ``+``, ``•`` at line start) within the bounds."""
    return _within(len(_BULLET.findall(text)), **bounds)


def highlighted_sections(text: str, **bounds) -> bool:
    """``*highlighted*`` spans (markdown emphasis; bold ``**x**`` counts once)."""
    return _within(len(_HIGHLIGHT.findall(text.replace("**", "*"))), **bounds)


def placeholders(text: str, **bounds) -> bool:
    """Square-bracket placeholders such as ``[address]``."""
    return _within(len(_PLACEHOLDER.findall(text)), **bounds)


def all_lowercase(text: str) -> bool:
    return text == text.lower() and any(c.isalpha() for c in text)


def all_uppercase(text: str) -> bool:
    return text == text.upper() and any(c.isalpha() for c in text)


def capital_words(text: str, **bounds) -> bool:
    """Words written fully in capitals (at least two letters: ``I`` and ``A`` do not count)."""
    return _within(sum(1 for w in _WORD.findall(text) if len(w) > 1 and w.isupper()), **bounds)


def starts_with(text: str, phrase: str) -> bool:
    """Starts with ``phrase`` (case-insensitive, leading whitespace ignored)."""
    return text.strip().lower().startswith(phrase.strip().lower())


def ends_with(text: str, phrase: str) -> bool:
    """Ends with ``phrase`` exactly, nothing after it but whitespace (case-insensitive)."""
    return text.strip().lower().endswith(phrase.strip().lower())


def no_commas(text: str) -> bool:
    return "," not in text and "\uff0c" not in text


def wrapped_in_quotes(text: str) -> bool:
    stripped = text.strip()
    return len(stripped) >= 2 and stripped[0] == stripped[-1] == '"'


def title(text: str) -> bool:
    """Contains a title in double angular brackets, e.g. ``<<poem of joy>>``."""
    return bool(_TITLE.search(text))


def postscript(text: str, marker: str = "P.S.") -> bool:
    """A line starting with the postscript marker (``P.S.``, ``P.P.S``)."""
    return bool(re.search(rf"^\s*{re.escape(marker)}", text, re.MULTILINE | re.IGNORECASE))


def section_count(text: str, splitter: str = "Section", **bounds) -> bool:
    """Sections introduced by ``SPLITTER N`` at a line start (``Section 1``, ``SECTION 2``)."""
    return _within(
        len(re.findall(rf"^\s*{re.escape(splitter)}\s+\d+", text, re.MULTILINE | re.IGNORECASE)), **bounds
    )


CHECKERS: dict[str, Callable[..., bool]] = {
    f.__name__: f
    for f in (
        word_count,
        sentence_count,
        paragraph_count,
        keywords_present,
        keywords_forbidden,
        keyword_frequency,
        letter_frequency,
        json_format,
        markdown_headings,
        bullet_count,
        highlighted_sections,
        placeholders,
        all_lowercase,
        all_uppercase,
        capital_words,
        starts_with,
        ends_with,
        no_commas,
        wrapped_in_quotes,
        title,
        postscript,
        section_count,
    )
}
_BOUNDED = {
    "word_count",
    "sentence_count",
    "paragraph_count",
    "keyword_frequency",
    "letter_frequency",
    "markdown_headings",
    "bullet_count",
    "highlighted_sections",
    "placeholders",
    "capital_words",
    "section_count",
}
_BOUND_KEYS = {"min", "max", "exactly"}


def check_constraint(text: str, constraint: dict) -> bool:
    """Whether ``text`` satisfies one constraint ``{"type": KIND, **params}``."""
    if not isinstance(constraint, dict) or "type" not in constraint:
        raise ValueError(f"A constraint is a dict with a 'type' key, got {constraint!r}.")
    kind = constraint["type"]
    if kind not in CHECKERS:
        raise ValueError(f"Unknown constraint type {kind!r}; known: {sorted(CHECKERS)}.")
    params = {k: v for k, v in constraint.items() if k != "type"}
    if kind in _BOUNDED:
        bounds = {k: params[k] for k in _BOUND_KEYS & params.keys()}
        if not bounds or any(not isinstance(v, int) or isinstance(v, bool) for v in bounds.values()):
            raise ValueError(f"Constraint {kind!r} needs integer 'min', 'max' or 'exactly', got {params!r}.")
        if "exactly" in bounds and len(bounds) > 1:
            raise ValueError(f"Constraint {kind!r}: give 'exactly' alone, or 'min'/'max', not both.")
    try:
        return bool(CHECKERS[kind](text, **params))
    except TypeError as exc:
        raise ValueError(f"Constraint {kind!r}: wrong parameters {sorted(params)} ({exc}).") from exc
