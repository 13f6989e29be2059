"""VerifyIf constraint checkers: one rule-based verifier per kind of instruction-following constraint.

A constraint is a dict ``{"type": KIND, **params}``; ``CHECKERS[KIND](text, **params) -> bool``.
Counts accept ``min``/``max`` bounds (inclusive) or ``exactly``. ``validate_constraint`` checks a
constraint's parameters once (the data loaders call it when a dataset is loaded) and raises ``ValueError``
naming the field to change; a valid constraint's checker then never raises for any text and runs in time
linear in its length (every regex below is anchored so that no run of one character is rescanned).

Checkers read what a reader sees (``normalize.py``): ``CHECKERS[KIND]`` first applies ``visible_text`` (NFKC,
format characters removed), and the functions below assume it was applied. Words are runs of letters and
digits (``_`` separates them); letter case is the Unicode category (``Lu``/``Lt`` upper, ``Ll`` lower); a
forbidden keyword and an upper bound on a count also see look-alike letters folded to Latin ones, while a
keyword that must appear, or a lower bound, counts real letters only.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import unicodedata
from collections.abc import Callable

from trl_gptoss.rewards.normalize import COMMAS, fold_lookalikes, visible_text

_WORD = re.compile(r"[^\W_]+(?:['-]++[^\W_]+)*")  # "don't", "three-four" are one word each; "a_b" is two
_SENTENCE_END = re.compile(r"[.!?](?![.!?])(?=\s|$)")  # the last mark of a run: linear on "....."
_BULLET = re.compile(r"^[ \t]*[*\-+•][ \t]+\S", re.MULTILINE)  # [ \t], not \s: \s would span blank lines
_HEADING = re.compile(r"^[ \t]{0,3}#{1,6}[ \t]+\S", re.MULTILINE)
_HIGHLIGHT = re.compile(r"\*[^\n*]+\*")
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]+\]")
_TITLE = re.compile(r"<<[^<>\n]+>>")


def _within(count: int, min=None, max=None, exactly=None) -> bool:
    if exactly is not None:
        return count == exactly
    return (min is None or count >= min) and (max is None or count <= max)


def word_count(text: str, **bounds) -> bool:
    """Number of words (letters and digits, apostrophes and hyphens inside words) within the bounds."""
    return _within(len(_WORD.findall(text)), **bounds)


def sentence_count(text: str, **bounds) -> bool:
    """Sentences: runs ending in ``.``, ``!`` or ``?`` followed by space/end, plus an unterminated tail."""
    stripped = text.strip()
    ends = len(_SENTENCE_END.findall(stripped))
    tail = 1 if stripped and not _SENTENCE_END.search(stripped[-3:] + " ") else 0
    return _within(ends + tail, **bounds)


def paragraph_count(text: str, **bounds) -> bool:
    """Paragraphs are runs of non-blank lines separated by blank lines (or IFEval's ``***`` divider lines)."""
    count, inside = 0, False
    for line in text.splitlines():
        separator = not line.strip() or line.strip() == "***"
        count += not separator and not inside
        inside = not separator
    return _within(count, **bounds)


@functools.lru_cache(maxsize=1024)
def _keyword_pattern(keyword: str) -> re.Pattern:
    """``keyword`` as a whole word in LOWERCASED text. The literal comes first so the regex engine scans
    for it at C speed; the "no word character before it" check is a lookbehind placed after it."""
    literal = re.escape(keyword.lower())
    return re.compile(rf"{literal}(?<![^\W_]{literal})(?![^\W_])")


@functools.lru_cache(maxsize=256)
def _line_start_pattern(prefix: str, then: str = "") -> re.Pattern:
    return re.compile(rf"^[ \t]*{re.escape(prefix)}{then}", re.MULTILINE | re.IGNORECASE)


def _within_both(written: int, folded: int, min=None, max=None, exactly=None) -> bool:
    """A lower bound met by what is written, an upper bound by what it looks like (look-alikes folded)."""
    if exactly is not None:
        return written == folded == exactly
    return _within(written, min=min) and _within(folded, max=max)


def keywords_present(text: str, keywords: list[str]) -> bool:
    """Every keyword appears as a whole word/phrase (case-insensitive), in real letters."""
    lowered = text.lower()
    return all(_keyword_pattern(visible_text(k)).search(lowered) for k in keywords)


def keywords_forbidden(text: str, keywords: list[str]) -> bool:
    """No keyword appears as a whole word/phrase (case-insensitive, look-alike letters folded): ``cat`` does
    not forbid ``category``; ``саt`` (Cyrillic ``с``, ``а``) and ``c_a_t`` are not ``cat``, ``the_cat`` is."""
    folded = fold_lookalikes(text).lower()
    return not any(_keyword_pattern(fold_lookalikes(visible_text(k))).search(folded) for k in keywords)


def keyword_frequency(text: str, keyword: str, **bounds) -> bool:
    """Whole-word occurrences of ``keyword`` (case-insensitive) within the bounds."""
    keyword = visible_text(keyword)
    written = len(_keyword_pattern(keyword).findall(text.lower()))
    folded = len(_keyword_pattern(fold_lookalikes(keyword)).findall(fold_lookalikes(text).lower()))
    return _within_both(written, folded, **bounds)


def letter_frequency(text: str, letter: str, **bounds) -> bool:
    """Occurrences of one letter, case-insensitive."""
    if len(letter) != 1:
        raise ValueError(f"letter_frequency: 'letter' must be one character, got {letter!r}.")
    letter = visible_text(letter).lower()
    written = text.lower().count(letter)
    folded = fold_lookalikes(text).lower().count(fold_lookalikes(letter))
    return _within_both(written, folded, **bounds)


def _unfence(text: str) -> str:
    """The body of a response wrapped in one ```json (or bare ```) fence; the text itself otherwise."""
    stripped = text.strip()
    first, _, rest = stripped.partition("\n")
    body, _, last = rest.rpartition("\n")
    if first.strip() in ("```", "```json", "```JSON") and last.strip() == "```":
        return body
    return text


def json_format(text: str) -> bool:
    """The whole response is valid JSON (a surrounding ```json fence is allowed)."""
    try:
        json.loads(_unfence(text))
    except (ValueError, RecursionError):  # also 5000-digit numbers and "[[[[..." nested past the stack
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


def _has_case(text: str, wanted: str, refused: tuple[str, ...]) -> bool:
    """Some letter of category ``wanted`` and none of ``refused``."""
    found = False
    for ch in text:
        category = unicodedata.category(ch)
        if category in refused:
            return False
        found = found or category == wanted
    return found


def all_lowercase(text: str) -> bool:
    """Cased letters only lowercase (``Ll``), at least one; no ``Lu``/``Lt`` letter in any script or font."""
    if text.isascii():
        return text.islower()
    return _has_case(text, "Ll", ("Lu", "Lt"))


def all_uppercase(text: str) -> bool:
    """Cased letters only uppercase (``Lu``), at least one; no ``Ll``/``Lt`` letter in any script or font."""
    if text.isascii():
        return text.isupper()
    return _has_case(text, "Lu", ("Ll", "Lt"))


def capital_words(text: str, **bounds) -> bool:
    """Words written fully in capitals (at least two letters: ``I`` and ``A`` do not count)."""
    candidates = " ".join(token for token in text.split() if not token.islower())  # skip lowercase tokens fast
    return _within(sum(1 for w in _WORD.findall(candidates) if len(w) > 1 and _is_capitals(w)), **bounds)


def _is_capitals(word: str) -> bool:
    return word.isupper() if word.isascii() else _has_case(word, "Lu", ("Ll", "Lt"))


def starts_with(text: str, phrase: str) -> bool:
    """Starts with ``phrase`` (case-insensitive, leading whitespace ignored)."""
    return text.strip().lower().startswith(visible_text(phrase).strip().lower())


def ends_with(text: str, phrase: str) -> bool:
    """Ends with ``phrase`` exactly, nothing after it but whitespace (case-insensitive)."""
    return text.strip().lower().endswith(visible_text(phrase).strip().lower())


def no_commas(text: str) -> bool:
    """No comma, nor anything that reads as one (``‚`` U+201A, ``、``, ``،``; NFKC already made ``，`` a comma)."""
    return not any(comma in text for comma in COMMAS)


def wrapped_in_quotes(text: str) -> bool:
    stripped = text.strip()
    return len(stripped) >= 2 and stripped[0] == stripped[-1] == '"'


def title(text: str) -> bool:
    """Contains a title in double angular brackets, e.g. ``<<poem of joy>>``."""
    return bool(_TITLE.search(text))


def postscript(text: str, marker: str = "P.S.") -> bool:
    """A line starting with the postscript marker (``P.S.``, ``P.P.S``)."""
    return bool(_line_start_pattern(marker).search(text))


def section_count(text: str, splitter: str = "Section", **bounds) -> bool:
    """Sections introduced by ``SPLITTER N`` at a line start (``Section 1``, ``SECTION 2``)."""
    return _within(len(_line_start_pattern(splitter, r"[ \t]+\d").findall(text)), **bounds)


def _on_visible_text(check: Callable[..., bool]) -> Callable[..., bool]:
    """``check`` applied to what a reader sees (``visible_text``); same name, signature and docstring."""

    @functools.wraps(check)
    def checker(text: str, **params) -> bool:
        return check(visible_text(text), **params)

    return checker


CHECKERS: dict[str, Callable[..., bool]] = {
    f.__name__: _on_visible_text(f)
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
_BOUND_KEYS = ("min", "max", "exactly")


def _nonempty_str(value) -> str | None:
    return None if isinstance(value, str) and value.strip() else "a non-empty string"


def _one_char(value) -> str | None:
    return None if isinstance(value, str) and len(value) == 1 and not value.isspace() else "one character"


def _keyword_list(value) -> str | None:
    if isinstance(value, list) and value and all(_nonempty_str(k) is None for k in value):
        return None
    return "a non-empty list of non-empty strings (a single string is not a list of keywords)"


def _count(value) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else "an integer >= 0"


_PARAM_RULES: dict[str, Callable[[object], str | None]] = {
    "keywords": _keyword_list,
    "keyword": _nonempty_str,
    "letter": _one_char,
    "phrase": _nonempty_str,
    "marker": _nonempty_str,
    "splitter": _nonempty_str,
    **dict.fromkeys(_BOUND_KEYS, _count),
}


@functools.cache
def _named_params(kind: str) -> tuple[set[str], set[str]]:
    """``(required, allowed)`` parameter names of a checker, read from its signature."""
    params = list(inspect.signature(CHECKERS[kind]).parameters.values())[1:]  # drop ``text``
    named = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    required = {p.name for p in named if p.default is inspect.Parameter.empty}
    allowed = {p.name for p in named} | (set(_BOUND_KEYS) if kind in _BOUNDED else set())
    return required, allowed


def validate_constraint(constraint) -> None:
    """Raise ``ValueError`` naming the field to change unless ``constraint`` is a well-formed constraint.

    Checks: a dict with a known ``type``; no unknown or missing parameters; each parameter's type (keyword
    lists are non-empty lists of non-empty strings, ``letter`` is one character, bounds are integers >= 0);
    counted kinds have ``exactly`` alone or ``min``/``max`` with ``min <= max``.
    """
    if not isinstance(constraint, dict) or "type" not in constraint:
        raise ValueError(f"A constraint is a dict with a 'type' key, got {constraint!r}.")
    kind = constraint["type"]
    if not isinstance(kind, str) or kind not in CHECKERS:
        raise ValueError(f"Unknown constraint type {kind!r}; known: {sorted(CHECKERS)}.")
    params = {k: v for k, v in constraint.items() if k != "type"}
    required, allowed = _named_params(kind)
    if params.keys() - allowed or required - params.keys():
        raise ValueError(
            f"Constraint {kind!r}: wrong parameters {sorted(params)}; required {sorted(required)}, "
            f"allowed {sorted(allowed)}."
        )
    for name, value in params.items():
        problem = _PARAM_RULES[name](value) if name in _PARAM_RULES else None
        if problem:
            raise ValueError(f"Constraint {kind!r}: field {name!r} must be {problem}, got {value!r}.")
    if kind in _BOUNDED:
        _check_bounds(kind, params)


def _check_bounds(kind: str, params: dict) -> None:
    bounds = {k: params[k] for k in _BOUND_KEYS if k in params}
    if not bounds:
        raise ValueError(f"Constraint {kind!r} needs integer 'min', 'max' or 'exactly', got {params!r}.")
    if "exactly" in bounds and len(bounds) > 1:
        raise ValueError(f"Constraint {kind!r}: give 'exactly' alone, or 'min'/'max', not both.")
    if bounds.get("min", 0) > bounds.get("max", bounds.get("min", 0)):
        raise ValueError(f"Constraint {kind!r}: 'min' ({bounds['min']}) is greater than 'max' ({bounds['max']}).")


def check_constraint(text: str, constraint: dict) -> bool:
    """Whether ``text`` satisfies one constraint ``{"type": KIND, **params}`` (validated first)."""
    validate_constraint(constraint)
    params = {k: v for k, v in constraint.items() if k != "type"}
    return bool(CHECKERS[constraint["type"]](text, **params))
