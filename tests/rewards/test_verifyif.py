"""VerifyIf: every constraint kind with a passing and a failing response, scores, errors."""

import json

import pytest

from trl_gptoss.rewards import (
    CHECKERS,
    check_constraint,
    score_constraints,
    verifyif_reward,
    verifyif_strict_reward,
)

# (constraint, passing response, failing response)
CASES = [
    ({"type": "word_count", "min": 3, "max": 5}, "one two three-four don't", "one two"),
    ({"type": "word_count", "exactly": 2}, "hello world", "hello big world"),
    ({"type": "sentence_count", "exactly": 2}, "It rains. Is it cold?", "It rains. Is it cold? Yes!"),
    ({"type": "sentence_count", "max": 1}, "Version 3.5 is out", "Version 3.5 is out. Try it."),
    ({"type": "paragraph_count", "exactly": 2}, "First para.\n\nSecond para.", "Only one\nparagraph here."),
    ({"type": "paragraph_count", "exactly": 2}, "A\n***\nB", "A\n\nB\n\nC"),
    (
        {"type": "keywords_present", "keywords": ["GPU", "sink token"]},
        "A gpu uses a Sink token.",
        "A GPU only.",
    ),
    ({"type": "keywords_forbidden", "keywords": ["cat"]}, "A category of dogs.", "The Cat sat."),
    ({"type": "keyword_frequency", "keyword": "AI", "min": 2}, "AI here, ai there.", "AI once; said."),
    ({"type": "letter_frequency", "letter": "z", "min": 3}, "Zany zebra zoo", "lazy dog"),
    ({"type": "json_format"}, '```json\n{"a": [1, 2]}\n```', '{"a": 1} trailing'),
    ({"type": "markdown_headings", "min": 2}, "# Title\ntext\n## Part\nmore", "#hashtag\nTitle\n"),
    ({"type": "bullet_count", "exactly": 3}, "* a\n* b\n- c", "* a\n* b\nplain"),
    ({"type": "highlighted_sections", "min": 2}, "*one* and **two**", "*one* only"),
    ({"type": "placeholders", "min": 2}, "Dear [name], at [address].", "Dear [name]."),
    ({"type": "all_lowercase"}, "all small words 123", "Not all small"),
    ({"type": "all_uppercase"}, "ALL CAPS, 42!", "ALL CAPs"),
    ({"type": "capital_words", "max": 1}, "I like NASA a lot", "NASA and ESA"),
    ({"type": "starts_with", "phrase": "Dear team"}, "  dear Team, hello", "Hello, dear team"),
    ({"type": "ends_with", "phrase": "Any questions?"}, "Done. Any questions?\n", "Any questions? Bye"),
    ({"type": "no_commas"}, "No commas at all.", "Yes, one comma."),
    ({"type": "wrapped_in_quotes"}, '"quoted answer"', 'unquoted "partly"'),
    ({"type": "title"}, "<<A Poem>>\nroses", "<A Poem>\nroses"),
    ({"type": "postscript", "marker": "P.S."}, "Body.\nP.S. remember", "Body. ps remember"),
    (
        {"type": "section_count", "splitter": "Section", "exactly": 2},
        "SECTION 1\na\nSection 2\nb",
        "Section 1\nonly",
    ),
]


@pytest.mark.parametrize("constraint, good, bad", CASES, ids=[f"{c['type']}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_each_constraint_passes_and_fails(constraint, good, bad):
    assert check_constraint(good, constraint) is True
    assert check_constraint(bad, constraint) is False


def test_at_least_fifteen_kinds_all_covered():
    assert len(CHECKERS) >= 15
    assert {c["type"] for c, _, _ in CASES} == set(CHECKERS)


def test_scores_and_trl_signature():
    constraints = [{"type": "no_commas"}, {"type": "all_lowercase"}, {"type": "word_count", "max": 4}]
    scores = score_constraints("hello there, friend", constraints)
    assert scores.per_constraint == [("no_commas", False), ("all_lowercase", True), ("word_count", True)]
    assert scores.score == pytest.approx(2 / 3) and not scores.all_passed
    logged = {}
    completions = [
        [{"role": "assistant", "content": "hello there friend"}],
        [{"role": "assistant", "content": "Hello, there"}],
        "anything",
    ]
    columns = [json.dumps(constraints), constraints, None]
    soft = verifyif_reward(
        prompts=None,
        completions=completions,
        constraints=columns,
        log_extra=lambda k, v: logged.setdefault(k, v),
        trainer_state=None,
    )
    assert soft == [1.0, pytest.approx(1 / 3), None]
    assert json.loads(logged["constraints_passed"][0]) == [
        ["no_commas", True],
        ["all_lowercase", True],
        ["word_count", True],
    ]
    assert verifyif_strict_reward(completions, constraints=columns) == [1.0, 0.0, None]
    assert score_constraints("x", []).score == 1.0


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"kind": "no_commas"}, "'type' key"),
        ({"type": "telepathy"}, "Unknown constraint type"),
        ({"type": "word_count"}, "needs integer"),
        ({"type": "word_count", "min": "3"}, "'min' must be an integer"),
        ({"type": "word_count", "exactly": 3, "max": 4}, "'exactly' alone"),
        ({"type": "starts_with", "prefix": "x"}, "wrong parameters"),
        ({"type": "letter_frequency", "letter": "ab", "min": 1}, "one character"),
    ],
    ids=["no-type", "unknown", "no-bounds", "string-bound", "exactly-and-max", "bad-param", "long-letter"],
)
def test_bad_constraints_raise_value_error(constraint, message):
    with pytest.raises(ValueError, match=message):
        check_constraint("text", constraint)


def test_bad_constraint_columns_raise():
    with pytest.raises(ValueError, match="valid JSON"):
        verifyif_reward(["x"], constraints=["[{"])
    with pytest.raises(ValueError, match="'constraints'"):
        verifyif_reward(["x"])
