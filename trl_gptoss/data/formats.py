"""Row formatting: TRL conversational prompts, constraint descriptions, Hub-row converters.

Every loader returns rows ``{"prompt": [{"role": "user", "content": ...}], ...}`` (TRL's conversational
prompt format) plus the columns the matching reward reads: ``answer`` (ReTool, GSM8K) or ``constraints``
(VerifyIf, JSON text: Arrow needs one schema per column, and constraint dicts differ in their keys).
"""

from __future__ import annotations

import json
import math

from trl_gptoss.rewards.constraints import validate_constraint

RETOOL_INSTRUCTION = (
    "Solve the problem. You may call the python tool to compute or check intermediate results. "
    "Put the final answer in \\boxed{}."
)
GSM8K_INSTRUCTION = "Solve the problem step by step. End with a line of the form '#### <number>'."

_BOUND_WORDS = {"min": "at least", "max": "at most", "exactly": "exactly"}
_PLAIN_DESCRIPTIONS = {
    "json_format": "Your entire response must be valid JSON.",
    "all_lowercase": "Your entire response must be in lowercase letters; no capital letters are allowed.",
    "all_uppercase": "Your entire response must be in English capital letters.",
    "no_commas": "Do not use any commas in your response.",
    "wrapped_in_quotes": "Wrap your entire response in double quotation marks.",
    "title": "Include a title wrapped in double angular brackets, such as <<my title>>.",
}
_COUNTED = {
    "word_count": "words",
    "sentence_count": "sentences",
    "markdown_headings": "markdown headings (# ...)",
    "bullet_count": "markdown bullet points (* ...)",
    "highlighted_sections": "sections highlighted with *...*",
    "placeholders": "placeholders in square brackets such as [name]",
    "capital_words": "words in ALL CAPITALS",
}


def _bounds(constraint: dict) -> str:
    parts = [f"{_BOUND_WORDS[k]} {constraint[k]}" for k in ("exactly", "min", "max") if k in constraint]
    return " and ".join(parts)


def describe_constraint(c: dict) -> str:
    """The English instruction for one constraint (what the prompt tells the model)."""
    kind = c["type"]
    if kind in _PLAIN_DESCRIPTIONS:
        return _PLAIN_DESCRIPTIONS[kind]
    if kind in _COUNTED:
        return f"Use {_bounds(c)} {_COUNTED[kind]}."
    described = {
        "paragraph_count": lambda: f"Write {_bounds(c)} paragraphs separated by blank lines.",
        "keywords_present": lambda: f"Include the keywords {', '.join(repr(k) for k in c['keywords'])}.",
        "keywords_forbidden": lambda: f"Do not use the words {', '.join(repr(k) for k in c['keywords'])}.",
        "keyword_frequency": lambda: f"Use the word {c['keyword']!r} {_bounds(c)} times.",
        "letter_frequency": lambda: f"Use the letter {c['letter']!r} {_bounds(c)} times.",
        "starts_with": lambda: f"Start your response with {c['phrase']!r}.",
        "ends_with": lambda: f"End your response with the exact phrase {c['phrase']!r}; nothing may follow it.",
        "postscript": lambda: f"End with a postscript starting with {c.get('marker', 'P.S.')}.",
        "section_count": lambda: (
            f"Divide your response into {_bounds(c)} sections, each starting with '{c.get('splitter', 'Section')} N'."
        ),
    }
    if kind not in described:
        raise ValueError(f"No description for constraint type {kind!r}.")
    return described[kind]()


def field(row, path: str):
    """``row["a"]["b"]`` for ``path="a.b"`` (``[-1]`` indexes a list); ``ValueError`` naming the missing field."""
    value = row
    for part in path.replace("[", ".[").split("."):
        key = int(part[1:-1]) if part.startswith("[") else part
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"missing field {path!r}") from None
    return value


def question_text(value, name: str = "question") -> str:
    """A non-blank question string, else ``ValueError`` naming the field."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {name!r} must be a non-empty string, got {value!r}")
    return value


def answer_text(value, name: str = "answer") -> str:
    """The ground truth as text: a non-blank string, or an int/finite float written out.

    ``None`` is refused: ``str(None)`` would make ``"None"`` the answer, and ``\\boxed{None}`` would score.
    """
    if value is None:
        raise ValueError(f"field {name!r} is null; every row needs its ground-truth answer (drop the row)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"field {name!r} must be a string or a number, got {type(value).__name__} {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"field {name!r} must be a finite number, got {value!r}")
    text = str(value)
    if not text.strip():
        raise ValueError(f"field {name!r} is empty; every row needs its ground-truth answer")
    return text


def checked_constraints(constraints, name: str = "constraints") -> list[dict]:
    """``constraints`` if it is a non-empty list of valid constraints, else ``ValueError`` naming the entry."""
    if not isinstance(constraints, list) or not constraints:
        raise ValueError(f"field {name!r} must be a non-empty list of constraint dicts, got {constraints!r}")
    for i, constraint in enumerate(constraints):
        try:
            validate_constraint(constraint)
        except ValueError as exc:
            raise ValueError(f"field '{name}[{i}]': {exc}") from None
    return constraints


def user_prompt(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def retool_row(question: str, answer) -> dict:
    """A ReTool row; ``ValueError`` naming the field for a blank question or a null/blank answer."""
    prompt = user_prompt(f"{question_text(question)}\n\n{RETOOL_INSTRUCTION}")
    return {"prompt": prompt, "answer": answer_text(answer)}


def gsm8k_row(question: str, answer: str) -> dict:
    """A GSM8K row; ``answer`` is the worked solution ending in ``#### x``."""
    return {"prompt": user_prompt(f"{question_text(question)}\n\n{GSM8K_INSTRUCTION}"), "answer": answer_text(answer)}


def verifyif_row(instruction: str, constraints: list[dict]) -> dict:
    """The task text followed by one line per constraint; ``constraints`` (validated) stored as JSON text."""
    instruction = question_text(instruction, "instruction")
    lines = "\n".join(f"- {describe_constraint(c)}" for c in checked_constraints(constraints))
    return {
        "prompt": user_prompt(f"{instruction}\n\nFollow these rules:\n{lines}"),
        "constraints": json.dumps(constraints),
    }


def dapo_math_row(row: dict) -> dict:
    """A ``BytedTsinghua-SIA/DAPO-Math-17k`` row (ReTool's RL data) as a ReTool row.

    DAPO wraps each problem in an "Answer: $Answer" instruction; ReTool wants ``\\boxed{}``, so the
    problem is cut out of the wrapper (between the first blank line and the closing "Remember ..." line).
    """
    content = question_text(field(row, "prompt[-1].content"), "prompt[-1].content")
    body = content.split("\n\n", 1)[1] if "\n\n" in content else content
    body = body.rsplit("\n\nRemember", 1)[0].strip()
    return retool_row(body, answer_text(field(row, "reward_model.ground_truth"), "reward_model.ground_truth"))


def _relation_bounds(relation: str, n: int) -> dict:
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"the count must be an integer, got {n!r}")
    if relation == "less than":
        return {"max": n - 1}
    if relation == "at least":
        return {"min": n}
    raise ValueError(f"Unknown IFEval relation {relation!r}.")


_IFEVAL = {
    "punctuation:no_comma": lambda k: {"type": "no_commas"},
    "change_case:english_lowercase": lambda k: {"type": "all_lowercase"},
    "change_case:english_capital": lambda k: {"type": "all_uppercase"},
    "change_case:capital_word_frequency": lambda k: {
        "type": "capital_words",
        **_relation_bounds(k["capital_relation"], k["capital_frequency"]),
    },
    "detectable_format:json_format": lambda k: {"type": "json_format"},
    "detectable_format:title": lambda k: {"type": "title"},
    "detectable_format:number_bullet_lists": lambda k: {"type": "bullet_count", "exactly": k["num_bullets"]},
    "detectable_format:number_highlighted_sections": lambda k: {
        "type": "highlighted_sections",
        "min": k["num_highlights"],
    },
    "detectable_format:multiple_sections": lambda k: {
        "type": "section_count",
        "splitter": k["section_spliter"],
        "min": k["num_sections"],
    },
    "detectable_content:number_placeholders": lambda k: {
        "type": "placeholders",
        "min": k["num_placeholders"],
    },
    "detectable_content:postscript": lambda k: {"type": "postscript", "marker": k["postscript_marker"]},
    "keywords:existence": lambda k: {"type": "keywords_present", "keywords": k["keywords"]},
    "keywords:forbidden_words": lambda k: {"type": "keywords_forbidden", "keywords": k["forbidden_words"]},
    "keywords:frequency": lambda k: {
        "type": "keyword_frequency",
        "keyword": k["keyword"],
        **_relation_bounds(k["relation"], k["frequency"]),
    },
    "keywords:letter_frequency": lambda k: {
        "type": "letter_frequency",
        "letter": k["letter"],
        **_relation_bounds(k["let_relation"], k["let_frequency"]),
    },
    "length_constraints:number_words": lambda k: {
        "type": "word_count",
        **_relation_bounds(k["relation"], k["num_words"]),
    },
    "length_constraints:number_sentences": lambda k: {
        "type": "sentence_count",
        **_relation_bounds(k["relation"], k["num_sentences"]),
    },
    "length_constraints:number_paragraphs": lambda k: {
        "type": "paragraph_count",
        "exactly": k["num_paragraphs"],
    },
    "startend:end_checker": lambda k: {"type": "ends_with", "phrase": k["end_phrase"]},
    "startend:quotation": lambda k: {"type": "wrapped_in_quotes"},
}


def ifeval_row(row: dict) -> dict | None:
    """A ``google/IFEval`` row as a VerifyIf row, or ``None`` when it uses an instruction we cannot verify.

    IFEval stores ``instruction_id_list`` and a parallel list of ``kwargs`` dicts (unused keys are null).
    The prompt is kept verbatim: it already states the constraints.
    """
    ids, all_kwargs = field(row, "instruction_id_list"), field(row, "kwargs")
    if not isinstance(ids, list) or not isinstance(all_kwargs, list) or len(ids) != len(all_kwargs):
        raise ValueError("fields 'instruction_id_list' and 'kwargs' must be lists of the same length")
    if any(instruction_id not in _IFEVAL for instruction_id in ids):
        return None
    constraints = [_ifeval_constraint(i, kind, kwargs) for i, (kind, kwargs) in enumerate(zip(ids, all_kwargs))]
    prompt = user_prompt(question_text(field(row, "prompt"), "prompt"))
    return {"prompt": prompt, "constraints": json.dumps(constraints)}


def _ifeval_constraint(index: int, instruction_id: str, kwargs) -> dict:
    """One IFEval instruction as a validated constraint; ``ValueError`` naming ``kwargs[index]``."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"field 'kwargs[{index}]' must be a dict, got {kwargs!r}")
    present = {k: v for k, v in (kwargs or {}).items() if v is not None}
    try:
        constraint = _IFEVAL[instruction_id](present)
        validate_constraint(constraint)
    except (KeyError, TypeError, ValueError) as exc:
        problem = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"field 'kwargs[{index}]' ({instruction_id}): {problem}; got {present!r}") from None
    return constraint
