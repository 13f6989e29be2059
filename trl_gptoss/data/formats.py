"""Row formatting: TRL conversational prompts, constraint descriptions, Hub-row converters.

Every loader returns rows ``{"prompt": [{"role": "user", "content": ...}], ...}`` (TRL's conversational
prompt format) plus the columns the matching reward reads: ``answer`` (ReTool, GSM8K) or ``constraints``
(VerifyIf, JSON text: Arrow needs one schema per column, and constraint dicts differ in their keys).
"""

from __future__ import annotations

import json

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
        "ends_with": lambda: (
            f"End your response with the exact phrase {c['phrase']!r}; nothing may follow it."
        ),
        "postscript": lambda: f"End with a postscript starting with {c.get('marker', 'P.S.')}.",
        "section_count": lambda: (
            f"Divide your response into {_bounds(c)} sections, each starting with "
            f"'{c.get('splitter', 'Section')} N'."
        ),
    }
    if kind not in described:
        raise ValueError(f"No description for constraint type {kind!r}.")
    return described[kind]()


def user_prompt(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def retool_row(question: str, answer: str) -> dict:
    return {"prompt": user_prompt(f"{question}\n\n{RETOOL_INSTRUCTION}"), "answer": str(answer)}


def gsm8k_row(question: str, answer: str) -> dict:
    return {"prompt": user_prompt(f"{question}\n\n{GSM8K_INSTRUCTION}"), "answer": answer}


def verifyif_row(instruction: str, constraints: list[dict]) -> dict:
    """The task text followed by one line per constraint; ``constraints`` stored as JSON text."""
    lines = "\n".join(f"- {describe_constraint(c)}" for c in constraints)
    return {
        "prompt": user_prompt(f"{instruction}\n\nFollow these rules:\n{lines}"),
        "constraints": json.dumps(constraints),
    }


def dapo_math_row(row: dict) -> dict:
    """A ``BytedTsinghua-SIA/DAPO-Math-17k`` row (ReTool's RL data) as a ReTool row.

    DAPO wraps each problem in an "Answer: $Answer" instruction; ReTool wants ``\\boxed{}``, so the
    problem is cut out of the wrapper (between the first blank line and the closing "Remember ..." line).
    """
    content = row["prompt"][-1]["content"]
    body = content.split("\n\n", 1)[1] if "\n\n" in content else content
    body = body.rsplit("\n\nRemember", 1)[0].strip()
    return retool_row(body, row["reward_model"]["ground_truth"])


def _relation_bounds(relation: str, n: int) -> dict:
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
    constraints = []
    for instruction_id, kwargs in zip(row["instruction_id_list"], row["kwargs"]):
        if instruction_id not in _IFEVAL:
            return None
        constraints.append(
            _IFEVAL[instruction_id]({k: v for k, v in (kwargs or {}).items() if v is not None})
        )
    return {"prompt": user_prompt(row["prompt"]), "constraints": json.dumps(constraints)}


SUPPORTED_IFEVAL_INSTRUCTIONS = tuple(sorted(_IFEVAL))
