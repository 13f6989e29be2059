"""Routing replay: a perturbed router would route differently; with replay the second pass routes exactly like
the recorded one (and, when only unselected logits moved, reproduces its log-probs bit for bit)."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

from trl_gptoss import FA3_SINK
from trl_gptoss.experts import patch_gpt_oss_experts
from trl_gptoss.experts.routing import RoutingRecord, record_routing, replay_routing
from trl_gptoss.testing import tiny_gpt_oss

ATTENTION = ["eager", FA3_SINK]
BATCH, LENGTH = 2, 48


def token_log_probs(model, input_ids, **kwargs):
    logits = model(input_ids=input_ids, **kwargs).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def _batch(seed=0):
    return torch.randint(0, 512, (BATCH, LENGTH), generator=torch.Generator().manual_seed(seed))


def _model(attn, seed=11):
    model = tiny_gpt_oss(seed=seed, attn_implementation=attn, num_local_experts=8, num_experts_per_tok=2)
    patch_gpt_oss_experts(model)
    return model


def _perturb_router_weights(model, scale=0.5, seed=5):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GptOssTopKRouter):
                module.weight.add_(torch.randn(module.weight.shape, generator=generator) * scale)
                module.bias.add_(torch.randn(module.bias.shape, generator=generator) * scale)


@contextlib.contextmanager
def boost_unselected_experts(model, record, boost=30.0):
    """Simulated router drift: raise the logits of every expert the record did NOT select, leaving the selected
    logits untouched; an unreplayed router then picks other experts, a replayed one sees unchanged weights."""
    routers = [m for m in model.modules() if isinstance(m, GptOssTopKRouter)]

    def make_hook(layer):
        def hook(module, args, output):
            selected = torch.zeros_like(output[0], dtype=torch.bool)
            selected.scatter_(-1, record.indices[layer].long(), True)
            logits = output[0] + boost * (~selected)
            top_values, top_index = torch.topk(logits, module.top_k, dim=-1)
            return logits, torch.softmax(top_values, dim=-1), top_index

        return hook

    handles = [router.register_forward_hook(make_hook(i)) for i, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _same_routing(a: RoutingRecord, b: RoutingRecord) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.indices, b.indices))


@pytest.mark.parametrize("attn", ATTENTION)
def test_replay_pins_routing_and_log_probs(attn):
    model, input_ids = _model(attn), _batch()
    with torch.no_grad(), record_routing(model) as first:
        first_log_probs = token_log_probs(model, input_ids)
    assert first.num_tokens == BATCH * LENGTH and first.indices[0].dtype == torch.uint8
    with torch.no_grad(), boost_unselected_experts(model, first):
        with record_routing(model) as drifted:
            drifted_log_probs = token_log_probs(model, input_ids)
        with replay_routing(model, first), record_routing(model) as replayed:
            replayed_log_probs = token_log_probs(model, input_ids)
    assert not _same_routing(drifted, first), "the perturbation must change routing for the test to mean anything"
    assert (drifted_log_probs - first_log_probs).abs().max() > 1e-2
    assert _same_routing(replayed, first)
    assert torch.equal(replayed_log_probs, first_log_probs)


def test_replay_with_perturbed_router_weights_keeps_experts_and_router_gradient():
    model, input_ids = _model("eager"), _batch(1)
    with torch.no_grad(), record_routing(model) as first:
        first_log_probs = token_log_probs(model, input_ids)
    _perturb_router_weights(model)
    with torch.no_grad(), record_routing(model) as unreplayed:
        unreplayed_log_probs = token_log_probs(model, input_ids)
    model.train()
    with replay_routing(model, first), record_routing(model) as replayed:
        replayed_log_probs = token_log_probs(model, input_ids)
        replayed_log_probs.sum().backward()
    assert not _same_routing(unreplayed, first) and _same_routing(replayed, first)
    # Same experts, only the recomputed routing weights moved: closer to the first pass than free routing.
    replay_gap = (replayed_log_probs.detach() - first_log_probs).abs().mean()
    free_gap = (unreplayed_log_probs - first_log_probs).abs().mean()
    assert 0 < replay_gap < free_gap
    for module in model.modules():
        if isinstance(module, GptOssTopKRouter):
            assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0


def test_replay_of_the_same_model_gives_identical_gradients():
    """Replayed routing weights are softmax(logits[idx]): same values and same router gradient as upstream."""
    model, input_ids = _model("eager"), _batch(2)
    model.train()
    with record_routing(model) as record:
        token_log_probs(model, input_ids).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with replay_routing(model, record):
        token_log_probs(model, input_ids).sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=0, msg=name)


def test_packed_input_record_and_replay():
    """Packed documents (B=1, restarting position_ids, cu_seq_lens kwargs) record one row per packed token."""
    model = _model(FA3_SINK)
    lengths = [13, 30, 21]
    input_ids = torch.randint(0, 512, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = dict(
        position_ids=position_ids,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max(lengths),
        max_length_k=max(lengths),
        use_cache=False,
    )
    with torch.no_grad(), record_routing(model) as first:
        first_log_probs = token_log_probs(model, input_ids, **packed)
    assert first.num_tokens == sum(lengths)
    with torch.no_grad(), boost_unselected_experts(model, first), replay_routing(model, first):
        assert torch.equal(token_log_probs(model, input_ids, **packed), first_log_probs)


def test_record_roundtrip_and_narrow(tmp_path):
    model, input_ids = _model("eager"), _batch()
    with torch.no_grad(), record_routing(model) as record:
        full = token_log_probs(model, input_ids)
    record.save(tmp_path / "routing.pt")
    loaded = RoutingRecord.load(tmp_path / "routing.pt")
    assert _same_routing(loaded, record) and loaded.layer_names == record.layer_names
    second_row = loaded.narrow(LENGTH, LENGTH)  # rows of batch element 1
    with torch.no_grad(), boost_unselected_experts(model, second_row), replay_routing(model, second_row):
        assert torch.equal(token_log_probs(model, input_ids[1:]), full[1:])
    external = RoutingRecord.from_layer_indices(model, [t.long() for t in record.indices])
    assert _same_routing(external, record)


def test_gradient_checkpointing_recompute_is_allowed():
    model, input_ids = _model("eager"), _batch()
    model.gradient_checkpointing_enable()
    model.train()
    with record_routing(model) as record:
        token_log_probs(model, input_ids, use_cache=False).sum().backward()
    with replay_routing(model, record):
        token_log_probs(model, input_ids, use_cache=False).sum().backward()
    assert record.num_tokens == BATCH * LENGTH


def test_padded_batch_record_and_replay():
    """Left-padded rows route too (one record row per router row); replay reproduces the recorded pass."""
    model, input_ids = _model("eager"), _batch(4)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :17] = 0
    with torch.no_grad(), record_routing(model) as first:
        first_log_probs = token_log_probs(model, input_ids, attention_mask=attention_mask)
    assert first.num_tokens == BATCH * LENGTH
    with torch.no_grad(), boost_unselected_experts(model, first), replay_routing(model, first):
        replayed = token_log_probs(model, input_ids, attention_mask=attention_mask)
    assert torch.equal(replayed, first_log_probs)


def test_importing_the_experts_package_leaves_routing_unloaded():
    """``trl_gptoss.experts`` is imported when transformers loads GPT-OSS (registration): routing is opt-in."""
    code = "import sys, trl_gptoss.experts; print('trl_gptoss.experts.routing' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "False"


def test_rows_without_a_route_fall_back_to_the_router_and_flips_are_counted():
    """A rollout engine's table: rows of -1 (no route) take the router's own experts; replayed rows are compared
    with the router's choice as sets and counted."""
    model, input_ids = _model("eager"), _batch()
    with torch.no_grad(), record_routing(model) as recorded:
        expected = token_log_probs(model, input_ids)
    tables = [t.to(torch.int16).clone() for t in recorded.indices]
    tables[0][:7] = -1  # the first sequence's first 7 tokens had no route in layer 0
    record = RoutingRecord.from_layer_indices(model, tables, allow_missing=True)
    assert RoutingRecord.from_dict(record.to_dict()).allow_missing and record.narrow(0, 7).indices[0].min() == -1
    with torch.no_grad(), boost_unselected_experts(model, recorded), replay_routing(model, record) as replayed:
        replayed_log_probs = token_log_probs(model, input_ids)
    rows = BATCH * LENGTH
    assert replayed.replayed_rows == rows * len(tables) - 7  # every row with a route, every layer
    assert replayed.flipped_rows == replayed.replayed_rows  # the boost moves every router off the record
    assert replayed.flip_fraction == 1.0
    # the 7 rows without a route followed the boosted router: only the first sequence from there on differs
    assert torch.equal(replayed_log_probs[1], expected[1])
    assert (replayed_log_probs[0, :6] - expected[0, :6]).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"or be -1 \(no route\)"):
        RoutingRecord.from_layer_indices(model, [t.clone().fill_(-2) for t in tables], allow_missing=True)
    with pytest.raises(ValueError, match=r"must lie in \[0, 8\), got \[-1"):
        RoutingRecord.from_layer_indices(model, tables)  # -1 only where the record says it may be missing
