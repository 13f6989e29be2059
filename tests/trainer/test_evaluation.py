"""``GptOssGRPOTrainer.evaluate``: held-out accuracy through the ``Sampler`` at TRL's ``eval_strategy``.

The taught tiny model answers "4" after 0-2 ``add`` calls; evaluation samples each held-out problem k times, grades
with the run's own reward (``answer``: "4" right, "5" wrong), and must not disturb training: the training rows of a
run with evaluation after every step equal those of the same run without it, and with ``max_staleness: 1`` no push
lands while the background batch samples.
"""

import pytest

from tests.trainer._workers import time_engine
from tests.trainer.helpers import SYSTEM, AddTool, answer_reward, grpo_args, load_taught, logged, prompt_dataset

EVAL = dict(
    eval_strategy="steps", eval_steps=1, eval_on_start=True, num_generations_eval=4, per_device_eval_batch_size=4
)


def _trainer(taught, tokenizer, tmp_path, eval_dataset=None, **overrides):
    from trl_gptoss.trainer import GptOssGRPOTrainer

    return GptOssGRPOTrainer(
        load_taught(taught[0]),
        answer_reward,
        args=grpo_args(tmp_path, **overrides),
        train_dataset=prompt_dataset([1, 2, 1, 2, 1, 2]),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        tools=[AddTool()],
        rollout_system=SYSTEM,
    )


def _eval_rows(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "eval_mean@4" in h]


def _train_rows(trainer) -> list[dict]:
    return [
        {k: v for k, v in h.items() if not k.startswith(("timing/", "step_time", "train_"))}
        for h in trainer.state.log_history
        if "loss" in h
    ]


def test_evaluation_at_start_and_every_step_grades_held_out_problems_with_the_runs_reward(taught, tokenizer, tmp_path):
    held_out = prompt_dataset([0, 1, 2], answer="4").add_item(
        {"prompt": [{"role": "user", "content": "Say four."}], "answer": "5"}
    )
    trainer = _trainer(taught, tokenizer, tmp_path, held_out, **EVAL)
    trainer.train()
    rows = _eval_rows(trainer)
    assert [r["eval_weights_step"] for r in rows] == [0.0, 1.0, 2.0]  # on start, then after each step
    for row in rows:
        assert row["eval_problems"] == 4 and row["eval_samples"] == 16
        assert row["eval_pass@1"] == pytest.approx(row["eval_mean@4"])
        assert row["eval_mean@4"] <= 0.75 + 1e-9  # the problem whose truth is "5" is never right
        assert row["eval_pass@4"] >= row["eval_mean@4"] and "eval_maj@4" not in row  # own rewards: no votes
        assert row["eval_tool_calls"] > 0 and row["eval_reward_errors"] == 0.0
    assert not any(k.startswith("eval_") for row in _train_rows(trainer) for k in row)  # logged apart
    assert rows[0]["eval_mean@4"] >= 0.5  # taught: the three "4" problems are mostly answered right
    assert len(trainer.held_out_results) == 4 and trainer.held_out_results[3].correct == [False] * 4
    trainer.close()


def test_an_evaluation_set_without_the_rewards_column_is_refused_at_construction(taught, tokenizer, tmp_path):
    held_out = prompt_dataset([1]).remove_columns("answer")
    with pytest.raises(ValueError, match="eval_dataset has no 'answer' column"):
        _trainer(taught, tokenizer, tmp_path, held_out, **EVAL)
    with pytest.raises(ValueError, match=r"eval_dataset\['held'\] has no 'answer' column"):
        _trainer(taught, tokenizer, tmp_path, {"held": held_out}, **EVAL)


def test_a_run_with_evaluation_trains_exactly_as_one_without(taught, tokenizer, tmp_path):
    held_out = prompt_dataset([1, 2], answer="4")
    plain = _trainer(taught, tokenizer, tmp_path / "plain")
    plain.train()
    evaluated = _trainer(taught, tokenizer, tmp_path / "evaluated", held_out, **EVAL)
    evaluated.train()
    assert _train_rows(evaluated) == _train_rows(plain)
    assert len(_eval_rows(evaluated)) == 3
    for trainer in (plain, evaluated):
        trainer.close()


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_evaluation_between_overlapped_steps_pushes_no_weights_under_a_running_batch(
    taught, tokenizer, tmp_path, server
):
    fields = dict(rollout_backend="vllm_server", rollout_server_url=server.base_url, max_staleness=1, max_steps=3)
    plain = _trainer(taught, tokenizer, tmp_path / "plain", learning_rate=3e-3, **fields)
    plain.train()
    evaluated = _trainer(
        taught,
        tokenizer,
        tmp_path / "evaluated",
        prompt_dataset([1, 2], answer="4"),
        learning_rate=3e-3,
        **fields,
        **EVAL,
    )
    requests, pushes = time_engine(evaluated.sampler.engine, push_delay_s=0.3)
    evaluated.train()
    assert [(q, p) for q in requests for p in pushes if q[0] < p[1] and p[0] < q[1]] == []
    assert logged(evaluated, "rollout/staleness") == [0.0, 1.0, 1.0]  # the background batches kept their place
    assert _train_rows(evaluated) == _train_rows(plain)
    assert [r["eval_weights_step"] for r in _eval_rows(evaluated)] == [0.0, 1.0, 2.0, 3.0]
    for trainer in (plain, evaluated):
        trainer.close()


@pytest.mark.distributed
def test_two_processes_evaluate_their_own_shares_and_report_the_same_metrics(taught, tmp_path):
    import torch

    from tests.trainer._eval_workers import evaluate_rank
    from trl_gptoss.testing.distributed import launch

    state_path = tmp_path / "taught.pt"
    torch.save(taught[0], state_path)
    rank0, rank1 = launch(evaluate_rank, 2, tmp_path / "run", str(state_path), str(tmp_path / "out"), timeout=600)
    assert rank0["sampled"] == [3 * 2] and rank1["sampled"] == [2 * 2]  # rows 0, 2, 4 and rows 1, 3; k = 2
    same = [{k: v for k, v in r["metrics"].items() if "timing/" not in k} for r in (rank0, rank1)]
    assert same[0] == same[1]  # gathered once, the same numbers everywhere (each rank's own timings aside)
    assert rank0["metrics"]["eval_problems"] == 5 and rank0["problems"] == [0, 1, 2, 3, 4]


def _one_process_evaluation(taught, tokenizer, tmp_path, server_url: str, step: int) -> dict:
    """Each evaluation set evaluated in this one process at ``step``, its two shares sampled with the seed streams
    the two ranks use: the metrics a 2-process evaluation must report."""
    from tests.trainer._eval_workers import eval_sets, fsdp2_args
    from trl_gptoss.evaluation import summarize
    from trl_gptoss.trainer import GptOssGRPOTrainer
    from trl_gptoss.trainer.held_out import evaluate_share, run_graders

    trainer = GptOssGRPOTrainer(
        load_taught(taught[0]),
        answer_reward,
        args=fsdp2_args(str(tmp_path), server_url, fsdp=False),
        train_dataset=prompt_dataset([1, 2, 0, 1]),
        eval_dataset=eval_sets(),
        processing_class=tokenizer,
        tools=[AddTool()],
        rollout_system=SYSTEM,
    )
    trainer.state.global_step = step
    graders = run_graders(trainer)
    metrics = {}
    for name, dataset in eval_sets().items():
        rows = [{**dict(row), "problem": index} for index, row in enumerate(dataset)]
        results = [r for share in range(2) for r in evaluate_share(trainer, rows, graders, share, 2)]
        summary = summarize(sorted(results, key=lambda r: r.problem), graders)
        metrics.update({f"eval_{name}_{key}": value for key, value in summary.items()})
    trainer.close()
    return metrics


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_fsdp2_ranks_with_no_or_uneven_problems_join_every_collective_and_report_one_process_metrics(
    taught, tokenizer, tmp_path, server
):
    """1 problem on 2 ranks (rank 1 has none) and 3 on 2 (uneven), at start, mid-run and after training: every
    rank joins the weight push before sampling its share, so the run neither blocks nor pairs mismatched
    collectives, and the metrics are those of one process evaluating the same problems with the same seeds."""
    import torch

    from tests.trainer._eval_workers import fsdp2_evaluate_rank
    from trl_gptoss.testing.distributed import launch

    state_path = tmp_path / "taught.pt"
    torch.save(taught[0], state_path)
    ranks = launch(fsdp2_evaluate_rank, 2, tmp_path / "run", str(state_path), str(tmp_path / "out"), server.base_url)
    assert all(r["fsdp2"] for r in ranks)
    assert _without_timings(ranks[0]) == _without_timings(ranks[1])  # gathered once, the same metrics everywhere
    assert [w for w in ranks[1]["warnings"] if "has none of the 1 held-out problems" in w]
    assert not [w for w in ranks[0]["warnings"] if "has none" in w]
    rows = _without_timings(ranks[0])
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        expected = _one_process_evaluation(
            taught, tokenizer, tmp_path / f"one-{row['step']}", server.base_url, row["step"]
        )
        assert row["eval_one_problems"] == 1 and row["eval_three_problems"] == 3
        assert {key: row[key] for key in expected} == expected, row["step"]


def _without_timings(rank: dict) -> list[dict]:
    """A rank's evaluation metrics per step (each evaluation set logs a row of its own), without what differs per
    rank and run: timings and wall times."""
    steps: dict[int, dict] = {}
    for row in rank["eval_rows"]:
        kept = {k: v for k, v in row.items() if "timing/" not in k and not k.endswith("seconds")}
        steps.setdefault(row["step"], {}).update(kept)
    return [steps[step] for step in sorted(steps)]
