"""Sharded (sp = 2, 4) vs unsharded per-document GPT-OSS: loss, logits and every gradient; DDP, FSDP2 and
accelerate-prepared DDP.

One spawn per world size runs all its scenarios (process start-up dominates the cost). Tiny GPT-OSS has
4 query / 2 KV heads: sp = 2 splits KV heads (sp <= Hkv), sp = 4 replicates them (sp > Hkv).
"""

from __future__ import annotations

import re

import pytest

from tests.parallel._workers import bad_input_worker, equivalence_worker
from trl_gptoss.testing.distributed import launch

pytestmark = pytest.mark.distributed

TOLERANCE = {"float32": 1e-5, "float64": 1e-12}
METRICS = ("loss", "logits", "logps", "entropy", "grad_sinks", "grad_attention", "grad_other", "score")
# temperature 0.7, entropy bonus 0.05 (entropies carry gradient), [7, V] tiles: several tiles per shard
TEMPERED = dict(temperature=0.7, entropy_coef=0.05, chunk=7)


def _scenario(sp, wrap, inner, dtype="float32", wrong_sinks=False, **head):
    name = f"sp{sp}-{inner}-{wrap}-{dtype}" + ("-first-sinks-everywhere" if wrong_sinks else "")
    name += "".join(f"-{key}{value}" for key, value in head.items())
    return dict(id=name, sp=sp, wrap=wrap, inner=inner, dtype=dtype, wrong_sinks=wrong_sinks, **head)


def _failures(results, scenarios):
    failures = []
    for rank, per_rank in enumerate(results):
        for scenario in scenarios:
            report, tol = per_rank[scenario["id"]], TOLERANCE[scenario["dtype"]]
            failures += [
                f"rank {rank} {scenario['id']}: {metric} max|diff| = {report[metric]:.3g} > {tol:g}"
                for metric in METRICS
                if not report[metric] <= tol
            ]
    return failures


WORLD2 = [_scenario(2, wrap, inner) for wrap in ("ddp", "fsdp2") for inner in ("eager", "fa3_sink")]
WORLD2.append(_scenario(2, "ddp", "eager", "float64"))
WORLD2.append(_scenario(2, "accelerate", "fa3_sink"))  # accelerate's prepare/no_sync/backward
WORLD2 += [_scenario(2, "ddp", "eager", "float64", **TEMPERED), _scenario(2, "fsdp2", "fa3_sink", **TEMPERED)]
WORLD2.append(_scenario(2, "fsdp2", "eager", "float64", batch="hostile", **TEMPERED))
WORLD2.append(_scenario(2, "fsdp2-head", "fa3_sink", "float64", **TEMPERED))
# R3 under SP: near-tie flips on the sharded model, the reference's routes packed, sharded and replayed over them
WORLD2 += [_scenario(2, w, inner, "float64", routes=True) for w, inner in (("fsdp2", "fa3_sink"), ("ddp", "eager"))]
WORLD4 = [_scenario(4, wrap, inner) for wrap in ("ddp", "fsdp2") for inner in ("eager", "fa3_sink")]
WORLD4.append(_scenario(2, "fsdp2", "fa3_sink"))  # two SP groups of 2 inside a data-parallel world of 4
WORLD4.append(_scenario(4, "ddp", "fa3_sink", **TEMPERED))


@pytest.mark.slow
@pytest.mark.parametrize(("world", "scenarios"), [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"])
def test_sharded_step_matches_unsharded(tmp_path, world, scenarios):
    results = launch(equivalence_worker, world, tmp_path, scenarios)
    assert not _failures(results, scenarios), "\n".join(_failures(results, scenarios))
    # the gradients compared are not vanishingly small: the sinks gradient is a real signal
    assert all(report["ref_sinks_grad"] > 1e-4 for per_rank in results for report in per_rank.values())
    for per_rank in results:  # no [rows, V] tensor beyond one tile in the loss pass, forward and backward
        for scenario in scenarios:
            report = per_rank[scenario["id"]]
            if scenario.get("routes"):  # the replay had flipped routes to replace
                assert report["flipped_tokens"] > 0, scenario["id"]
            assert report["vocab_rows_logits"] >= report["logits_rows"], "the tracker missed the logits"
            if "chunk" in scenario:
                assert report["vocab_rows"] <= scenario["chunk"], scenario["id"]


@pytest.mark.slow
def test_negative_control_first_sinks_on_every_rank_is_caught(tmp_path):
    """Giving every rank the sinks of heads [0, Hq/sp) (the upstream bug family) must fail the comparison."""
    scenarios = [_scenario(2, "ddp", "eager", wrong_sinks=True), _scenario(2, "fsdp2", "fa3_sink", wrong_sinks=True)]
    results = launch(equivalence_worker, 2, tmp_path, scenarios)
    for per_rank in results:
        for scenario in scenarios:
            report = per_rank[scenario["id"]]
            assert report["logits"] > 1e-2, f"{scenario['id']}: wrong sinks went unnoticed in the logits"
            assert report["grad_sinks"] > 1e-5, f"{scenario['id']}: wrong sinks went unnoticed in dsinks"
            assert report["loss"] > 1e-5 or report["logits"] > 1e-2


@pytest.mark.slow
def test_bad_input_raises_on_every_rank_without_hanging(tmp_path):
    expected = {
        "sp_not_dividing_world": r"sp_size=3 must divide the number of processes \(2\)",
        "sp_not_dividing_heads": "sp_size=2 must divide num_attention_heads=3",
        "sequence_shorter_than_sp": r"packed lengths \[1, 40\].*at least sp_size=2 tokens",
    }
    for rank, report in enumerate(launch(bad_input_worker, 2, tmp_path, timeout=120)):
        for case, pattern in expected.items():
            assert report[case] is not None, f"rank {rank}: {case} raised nothing"
            assert re.search(pattern, report[case]), f"rank {rank}: {case}: {report[case]!r}"
