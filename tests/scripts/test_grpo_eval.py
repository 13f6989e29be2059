"""The job's held-out evaluation set and its checks (before any model loads)."""

import pytest

from tests.scripts.test_config_errors import _error, _write_config
from trl_gptoss.data.tasks import TASKS
from trl_gptoss.scripts.grpo import load_dataset_for, parse_job_args
from trl_gptoss.scripts.grpo_eval import held_out_split

NO_EVAL = {"eval_strategy": "no", "eval_on_start": False, "eval_problems": 0}


@pytest.mark.parametrize(
    "changes, message",
    [
        pytest.param({"eval_problems": -1}, "eval_problems=-1", id="negative"),
        pytest.param({"eval_problems": True}, "eval_problems: true is not an integer", id="bool"),
        pytest.param({**NO_EVAL, "eval_problems": 8}, "eval_problems=8 but nothing evaluates them", id="unused"),
        pytest.param({"eval_problems": 0}, "eval_problems is 0", id="evaluates-nothing"),
        pytest.param({"num_generations_eval": 0}, "num_generations_eval", id="k-0"),
        pytest.param({"eval_problems": 10**12}, "eval_problems=1000000000000: at most 100000", id="problems-huge"),
        pytest.param(
            {"eval_problems": 100_000, "num_generations_eval": 8},
            "eval_problems=100000 x num_generations_eval=8 conversations exceed 262144",
            id="conversations",
        ),
        pytest.param(
            {"load_best_model_at_end": True, "save_strategy": "steps", "eval_strategy": "steps", "eval_steps": 2},
            "metric_for_best_model='loss' (load_best_model_at_end=True defaults it to 'loss')",
            id="best-by-loss",
        ),
    ],
)
def test_evaluation_settings_that_cannot_work_are_refused_before_loading(tmp_path, changes, message):
    assert message in _error(["--config", str(_write_config(tmp_path, changes))])


def _job(tmp_path, **changes):
    return parse_job_args(["--config", str(_write_config(tmp_path, changes))])


def test_generated_held_out_problems_come_from_another_seed_and_never_equal_a_training_prompt(tmp_path):
    job, training = _job(tmp_path, num_prompts=64, eval_problems=16)
    train, held_out = held_out_split(job, training, load_dataset_for(job, seed=training.seed))
    assert len(train) == 64 and 0 < len(held_out) <= 16 and set(held_out["task"]) == {"arithmetic"}
    assert not {repr(p) for p in held_out["prompt"]} & {repr(p) for p in train["prompt"]}
    assert {"prompt", "answer"} <= set(held_out.column_names)


def test_file_tasks_set_their_last_rows_aside_from_training(tmp_path):
    fields = dict(task="gsm8k", tool_names=[], model_name_or_path=str(tmp_path), bf16=False, eval_problems=5)
    job, training = parse_job_args(["--config", str(_write_config(tmp_path, fields))], check=False)
    rows = load_dataset_for(job, seed=0)
    train, held_out = held_out_split(job, training, rows)
    assert len(train) + len(held_out) == len(rows) and len(held_out) == 5
    assert held_out["prompt"] == rows["prompt"][-5:] and set(held_out["task"]) == {"gsm8k"}
    job.eval_problems = len(rows)
    with pytest.raises(SystemExit, match="sets aside every one"):
        held_out_split(job, training, rows)


def test_no_evaluation_leaves_the_training_rows_alone(tmp_path):
    job, training = _job(tmp_path, **NO_EVAL)
    rows = load_dataset_for(job, seed=0)
    assert held_out_split(job, training, rows) == (rows, None)


def test_with_a_dataset_limit_the_held_out_rows_come_from_the_end_and_training_keeps_the_first(tmp_path):
    """The rehearsals' shape: 2 training rows (the ones the tiny model is taught) and 2 held-out rows, disjoint."""
    fields = dict(task="gsm8k", tool_names=[], model_name_or_path=str(tmp_path), bf16=False, eval_problems=2)
    job, training = parse_job_args(["--config", str(_write_config(tmp_path, {**fields, "dataset_limit": 2}))])
    everything = TASKS["gsm8k"].load(source="sample")
    train, held_out = held_out_split(job, training, load_dataset_for(job, seed=0))
    assert train["prompt"] == everything["prompt"][:2] and held_out["prompt"] == everything["prompt"][-2:]


def test_retool_and_gsm8k_hold_out_hub_sets_of_their_own_and_verifyif_sets_rows_aside():
    """ReTool trains on DAPO-Math-17k and is evaluated on AIME 2024 (what ReTool reports), GSM8K on its test split;
    VerifyIf's Hub set (IFEval) has one split, so its held-out problems are rows set aside from training."""
    retool, gsm8k, verifyif = TASKS["retool"], TASKS["gsm8k"], TASKS["verifyif"]
    assert retool.has_held_out_hub and (retool.eval_hub.path, retool.eval_split) == ("HuggingFaceH4/aime_2024", "train")
    assert (
        gsm8k.has_held_out_hub
        and gsm8k.eval_hub is None
        and (gsm8k.hub.path, gsm8k.eval_split)
        == (
            "openai/gsm8k",
            "test",
        )
    )
    assert not verifyif.has_held_out_hub
    aime = {"id": 60, "problem": "Find $x$ if $x + 1 = 205$.", "solution": "...", "answer": "204", "year": 2024}
    row = retool.eval_hub.convert(aime)
    assert row["answer"] == "204" and "Find $x$ if $x + 1 = 205$." in row["prompt"][-1]["content"]
    reward = retool.reward(completions=[[{"role": "assistant", "content": "\\boxed{204}"}]], answer=[row["answer"]])
    assert reward == [1.0]
