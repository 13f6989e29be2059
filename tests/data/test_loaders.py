"""Loaders: shipped samples in TRL's conversational format, answers the rewards accept, Hub converters."""

import json

import pytest
from datasets import Dataset
from trl.data_utils import is_conversational

from trl_gptoss.data import TASKS, convert_hub_rows, describe_constraint, load_task_dataset, read_samples
from trl_gptoss.rewards import CHECKERS, gsm8k_reward, retool_reward, score_constraints, verifyif_reward


@pytest.mark.parametrize("task", [name for name, task in TASKS.items() if task.format_row is not None])
def test_samples_load_as_conversational_datasets(task):
    dataset = load_task_dataset(task)
    assert isinstance(dataset, Dataset) and 20 <= len(dataset) <= 50
    reward_column = "constraints" if task == "verifyif" else "answer"
    assert set(dataset.column_names) == {"prompt", reward_column}
    for row in dataset:
        assert is_conversational(row)
        assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].strip()
    assert len(load_task_dataset(task, limit=3)) == 3


def test_retool_sample_answers_score_plus_one_and_wrong_ones_minus_one():
    dataset = load_task_dataset("retool")
    assert all("\\boxed{}" in row["prompt"][0]["content"] for row in dataset)
    right = [f"Computed with python. \\boxed{{{a}}}" for a in dataset["answer"]]
    wrong = [f"\\boxed{{{a}1}}" for a in dataset["answer"]]
    assert retool_reward(right, answer=dataset["answer"]) == [1.0] * len(dataset)
    assert retool_reward(wrong, answer=dataset["answer"]) == [-1.0] * len(dataset)


def test_gsm8k_sample_solutions_score_one():
    dataset = load_task_dataset("gsm8k")
    assert all("\n#### " in a for a in dataset["answer"])
    # The worked solution itself is a correct completion; dropping its final line breaks it.
    assert gsm8k_reward(dataset["answer"], answer=dataset["answer"]) == [1.0] * len(dataset)
    truncated = [a.rsplit("\n", 1)[0] + "\nSo the result is 0." for a in dataset["answer"]]
    assert gsm8k_reward(truncated, answer=dataset["answer"]) == [0.0] * len(dataset)


def test_verifyif_samples_state_their_rules_and_references_pass():
    raw = read_samples("verifyif")
    dataset = load_task_dataset("verifyif")
    kinds = {c["type"] for row in raw for c in row["constraints"]}
    assert kinds == set(CHECKERS), "every constraint kind appears in the samples"
    for row, formatted in zip(raw, dataset):
        assert json.loads(formatted["constraints"]) == row["constraints"]
        for c in row["constraints"]:
            assert describe_constraint(c) in formatted["prompt"][0]["content"]
        assert score_constraints(row["reference"], row["constraints"]).all_passed, row["instruction"]
    references = [[{"role": "assistant", "content": r["reference"]}] for r in raw]
    assert verifyif_reward(references, constraints=dataset["constraints"]) == [1.0] * len(raw)


def test_hub_rows_convert_without_download():
    dapo = [
        {
            "prompt": [
                {
                    "role": "user",
                    "content": "Solve the following math problem step by step. The last line "
                    "should be Answer: $Answer.\n\nFind $1+1$.\n\nRemember to put your answer on its own "
                    'line after "Answer:".',
                }
            ],
            "reward_model": {"ground_truth": "2", "style": "rule-lang"},
        }
    ]
    retool = convert_hub_rows("retool", dapo)[0]
    assert retool["prompt"][0]["content"].startswith("Find $1+1$.") and retool["answer"] == "2"
    gsm = convert_hub_rows("gsm8k", [{"question": "2+2?", "answer": "2+2=4\n#### 4"}])[0]
    assert gsm["answer"].endswith("#### 4")
    null_kwargs = {"num_words": None, "relation": None, "keywords": None}
    ifeval = [
        {
            "prompt": "Write a poem.",
            "instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
            "kwargs": [dict(null_kwargs), {**null_kwargs, "num_words": 50, "relation": "less than"}],
        },
        {
            "prompt": "Answer in Hindi.",
            "instruction_id_list": ["language:response_language"],
            "kwargs": [{"language": "hi"}],
        },
    ]
    verify = convert_hub_rows("verifyif", ifeval)
    assert len(verify) == 1, "rows with an instruction we cannot verify are dropped"
    assert json.loads(verify[0]["constraints"]) == [{"type": "no_commas"}, {"type": "word_count", "max": 49}]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(task="math"), "Unknown task"),
        (dict(task="gsm8k", source="web"), "source"),
        (dict(task="gsm8k", limit=0), "limit"),
    ],
    ids=["task", "source", "limit"],
)
def test_bad_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_task_dataset(**kwargs)
