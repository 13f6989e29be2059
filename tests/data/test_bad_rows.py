"""Bad dataset rows fail at load time with an error naming the file, the line and the field."""

import json

import pytest

from trl_gptoss.data import convert_hub_rows, load_task_dataset
from trl_gptoss.data.formats import retool_row


def _write(tmp_path, lines) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


GOOD_RETOOL = {"question": "What is 2 + 2?", "answer": "4"}


@pytest.mark.parametrize(
    "task, bad_line, message",
    [
        ("retool", '{"question": "q", "answer": ', r"rows.jsonl:2: not valid JSON"),
        ("retool", "[1, 2]", r"rows.jsonl:2: a row must be a JSON object"),
        ("retool", {"question": "q"}, r"rows.jsonl:2: missing field 'answer'"),
        ("retool", {"question": "q", "answer": None}, r"rows.jsonl:2: field 'answer' is null"),
        ("retool", {"question": "q", "answer": "  "}, r"rows.jsonl:2: field 'answer' is empty"),
        ("retool", {"question": "q", "answer": True}, r"rows.jsonl:2: field 'answer' must be a string or a number"),
        ("retool", {"question": "", "answer": "1"}, r"rows.jsonl:2: field 'question' must be a non-empty string"),
        ("gsm8k", {"question": "q", "answer": None}, r"rows.jsonl:2: field 'answer' is null"),
        ("verifyif", {"instruction": "x"}, r"rows.jsonl:2: missing field 'constraints'"),
        (
            "verifyif",
            {
                "instruction": "x",
                "constraints": [{"type": "no_commas"}, {"type": "keywords_present", "keywords": "cat"}],
            },
            r"rows.jsonl:2: field 'constraints\[1\]': .*'keywords' must be a non-empty list",
        ),
        (
            "verifyif",
            {"instruction": "x", "constraints": [{"type": "word_count", "min": 9, "max": 2}]},
            r"rows.jsonl:2: field 'constraints\[0\]': .*'min' \(9\) is greater than 'max' \(2\)",
        ),
        ("verifyif", {"instruction": "x", "constraints": []}, r"rows.jsonl:2: field 'constraints' must be a non-empty"),
    ],
    ids=[
        "bad-json",
        "not-object",
        "missing",
        "null-answer",
        "blank-answer",
        "bool-answer",
        "blank-question",
        "gsm8k-null",
        "no-constraints",
        "keywords-str",
        "min-gt-max",
        "empty-constraints",
    ],
)
def test_bad_line_names_file_line_and_field(tmp_path, task, bad_line, message):
    good = GOOD_RETOOL if task != "verifyif" else {"instruction": "x", "constraints": [{"type": "no_commas"}]}
    path = _write(tmp_path, [good, bad_line, good])
    with pytest.raises(ValueError, match=message):
        load_task_dataset(task, source="jsonl", path=path)


def test_good_jsonl_file_loads_and_numbers_become_text(tmp_path):
    path = _write(
        tmp_path, [GOOD_RETOOL, "", {"question": "Half of 3?", "answer": 1.5}, {"question": "q", "answer": 7}]
    )
    dataset = load_task_dataset("retool", source="jsonl", path=path)
    assert dataset["answer"] == ["4", "1.5", "7"]
    with pytest.raises(ValueError, match="path="):
        load_task_dataset("retool", source="jsonl")


def test_null_answer_never_becomes_the_string_none():
    with pytest.raises(ValueError, match="'answer' is null"):
        retool_row("What is 2 + 2?", None)


def test_hub_rows_with_bad_fields_name_the_row_and_field():
    dapo = {"prompt": [{"role": "user", "content": "Solve.\n\nFind 1+1."}], "reward_model": {"ground_truth": None}}
    with pytest.raises(ValueError, match=r"retool Hub row 0: field 'reward_model.ground_truth' is null"):
        convert_hub_rows("retool", [dapo])
    with pytest.raises(ValueError, match=r"retool Hub row 0: missing field 'reward_model.ground_truth'"):
        convert_hub_rows("retool", [{"prompt": dapo["prompt"]}])
    with pytest.raises(ValueError, match=r"gsm8k Hub row 1: missing field 'answer'"):
        convert_hub_rows("gsm8k", [{"question": "q", "answer": "#### 1"}, {"question": "q"}])


@pytest.mark.parametrize(
    "instruction, kwargs, message",
    [
        ("length_constraints:number_words", {"relation": "less than", "num_words": "50"}, "count must be an integer"),
        ("keywords:existence", {"keywords": "cat"}, "'keywords' must be a non-empty list"),
        ("keywords:existence", {"keywords": []}, "'keywords' must be a non-empty list"),
        (
            "keywords:letter_frequency",
            {"letter": "ab", "let_relation": "at least", "let_frequency": 2},
            "one character",
        ),
        ("length_constraints:number_words", {"relation": "about", "num_words": 5}, "Unknown IFEval relation"),
        ("length_constraints:number_words", {"num_words": 5}, "missing 'relation'"),
    ],
    ids=["count-str", "keywords-str", "keywords-empty", "letter", "relation", "missing-kwarg"],
)
def test_ifeval_kwargs_of_the_wrong_type_are_refused_at_load(instruction, kwargs, message):
    row = {"prompt": "Write.", "instruction_id_list": ["punctuation:no_comma", instruction], "kwargs": [{}, kwargs]}
    with pytest.raises(ValueError, match=rf"verifyif Hub row 0: field 'kwargs\[1\]' \({instruction}\): .*{message}"):
        convert_hub_rows("verifyif", [row])


def test_non_utf8_line_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(json.dumps(GOOD_RETOOL).encode() + b'\n{"question": "caf\xe9?", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: not UTF-8 text \(invalid continuation byte at byte 17"):
        load_task_dataset("retool", source="jsonl", path=str(path))


def test_deeply_nested_json_names_file_and_line(tmp_path):
    deep = '{"question": "q", "answer": "1", "extra": ' + "[" * 200_000 + "]" * 200_000 + "}"
    path = _write(tmp_path, [GOOD_RETOOL, GOOD_RETOOL, deep])
    with pytest.raises(ValueError, match=r"rows.jsonl:3: JSON nested too deeply"):
        load_task_dataset("retool", source="jsonl", path=path)


@pytest.mark.parametrize("limit", [True, False, 2.0, "3", 0, -1])
def test_limit_that_is_not_a_positive_int_is_refused(limit):
    with pytest.raises(ValueError, match=rf"limit must be a positive int .*got {limit!r}"):
        load_task_dataset("retool", limit=limit)
