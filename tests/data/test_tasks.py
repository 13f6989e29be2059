"""The task table: one row per task, each row's loader, reward and tools agree with each other."""

import pytest

from trl_gptoss.data import TASKS, HubDataset, Task, get_task, load_task_dataset
from trl_gptoss.rewards import gsm8k_reward, retool_reward, verifyif_reward


def test_the_table_names_every_task_with_its_reward_and_tools():
    assert list(TASKS) == ["arithmetic", "retool", "gsm8k", "verifyif"]
    assert {name: (task.reward, task.tools) for name, task in TASKS.items()} == {
        "arithmetic": (retool_reward, ("python",)),
        "retool": (retool_reward, ("python",)),
        "gsm8k": (gsm8k_reward, ()),
        "verifyif": (verifyif_reward, ()),
    }
    assert all(name == task.name for name, task in TASKS.items())


@pytest.mark.parametrize("name", list(TASKS))
def test_every_row_loads_rows_its_reward_scores(name):
    task = TASKS[name]
    dataset = task.load(limit=4, num_prompts=6, seed=3)
    assert len(dataset) == 4 and "prompt" in dataset.column_names
    columns = {c: dataset[c] for c in dataset.column_names if c != "prompt"}
    scores = task.reward([[{"role": "assistant", "content": "no answer"}]] * 4, **columns)
    assert len(scores) == 4 and all(isinstance(s, float) for s in scores)


def test_generated_task_is_a_pure_function_of_the_seed_and_refuses_files():
    arithmetic = TASKS["arithmetic"]
    assert arithmetic.sources == ("generated",)
    assert arithmetic.load(num_prompts=5, seed=1)["answer"] == arithmetic.load(num_prompts=5, seed=1)["answer"]
    assert arithmetic.load(num_prompts=5, seed=1)["answer"] != arithmetic.load(num_prompts=5, seed=2)["answer"]
    with pytest.raises(ValueError, match="is generated"):
        arithmetic.load(source="hub")
    with pytest.raises(ValueError, match=r"TASKS\['arithmetic'\]\.load"):
        load_task_dataset("arithmetic")


def test_unknown_task_lists_the_names():
    with pytest.raises(ValueError, match=r"Unknown task 'sudoku'; choose one of \['arithmetic', 'gsm8k'"):
        get_task("sudoku")


def test_a_row_is_either_read_or_generated():
    with pytest.raises(ValueError, match="exactly one of format_row and generate"):
        Task("x", retool_reward)
    with pytest.raises(ValueError, match="a Hub dataset needs format_row"):
        Task("x", retool_reward, generate=lambda n, seed: None, hub=HubDataset("a/b", None, dict))
