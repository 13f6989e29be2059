"""TransformersEngine: log-probs are the sampled distribution's, batching never changes a seeded request."""

import asyncio

import pytest
import torch

from trl_gptoss.rollout import GenerationRequest, RolloutEngine, TransformersEngine
from trl_gptoss.rollout.sampling import processed_logprobs
from trl_gptoss.testing import tiny_gpt_oss


@pytest.fixture(scope="module")
def model():
    return tiny_gpt_oss(seed=0, initializer_range=0.15)


def _run(engine, requests):
    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return asyncio.run(go())


def _recomputed_logprobs(model, request, generation):
    """The trainer's view: one full forward over prompt + completion, same temperature/top-k/top-p."""
    ids = torch.tensor([request.prompt_ids + generation.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(request.prompt_ids) - 1 : -1]
    n = logits.shape[0]
    lp = processed_logprobs(
        logits, torch.full((n,), request.temperature), torch.full((n,), request.top_k), torch.full((n,), request.top_p)
    )
    return lp.gather(1, torch.tensor(generation.token_ids)[:, None]).squeeze(1)


REQUESTS = [
    GenerationRequest([5, 40, 41, 42, 7], max_new_tokens=12, temperature=0.7, seed=1),
    GenerationRequest([9, 8, 7], max_new_tokens=5, temperature=1.3, seed=2, top_k=20),
    GenerationRequest(list(range(100, 120)), max_new_tokens=9, temperature=1.0, seed=3, top_p=0.8),
    GenerationRequest([300, 301], max_new_tokens=7, temperature=0.5, seed=4, top_k=50, top_p=0.9),
]


def test_is_a_rollout_engine(model):
    engine = TransformersEngine(model, max_batch_size=4)
    assert isinstance(engine, RolloutEngine)
    assert engine.max_model_len == model.config.max_position_embeddings


# fp32: KV-cached decode and one full forward round logits differently (~1e-5 on logits of size ~10), and
# 1/temperature scales that; the float64 run shows the math itself is exact.
@pytest.mark.parametrize(
    ("dtype", "atol", "rtol"), [(torch.float32, 1e-5, 1e-6), (torch.float64, 1e-10, 0)], ids=["fp32", "fp64"]
)
def test_logprobs_equal_recomputed_at_same_temperature(model, dtype, atol, rtol):
    model = tiny_gpt_oss(seed=0, initializer_range=0.15, dtype=dtype)
    model.set_experts_implementation("eager")  # grouped_mm has no float64
    engine = TransformersEngine(model, max_batch_size=4)
    generations = _run(engine, REQUESTS)
    for request, generation in zip(REQUESTS, generations):
        assert len(generation.token_ids) == request.max_new_tokens and generation.finish_reason == "length"
        expected = _recomputed_logprobs(model, request, generation)
        got = torch.tensor(generation.logprobs, dtype=dtype)
        assert torch.allclose(got, expected, atol=atol, rtol=rtol), (request, (got - expected).abs().max())
        # and it is the processed distribution, not the raw one: temperature matters
        if request.temperature != 1.0:
            raw = _recomputed_logprobs(model, GenerationRequest(request.prompt_ids, 1), generation)
            assert (raw - expected).abs().max() > 1e-3


def test_batching_does_not_change_seeded_results(model):
    alone = [_run(TransformersEngine(model, max_batch_size=1), [r])[0] for r in REQUESTS]
    batched = _run(TransformersEngine(model, max_batch_size=4), REQUESTS)
    reversed_batch = _run(TransformersEngine(model, max_batch_size=3), REQUESTS[::-1])[::-1]
    for one, two, three in zip(alone, batched, reversed_batch):
        assert one.token_ids == two.token_ids == three.token_ids
        assert torch.allclose(torch.tensor(one.logprobs), torch.tensor(two.logprobs), atol=5e-5, rtol=0)  # fp32


def test_concurrent_requests_share_one_batch(model):
    engine = TransformersEngine(model, max_batch_size=8)
    calls = []
    original = engine.generate_batch
    engine.generate_batch = lambda requests: calls.append(len(requests)) or original(requests)
    _run(engine, REQUESTS)
    assert calls == [len(REQUESTS)]
    engine = TransformersEngine(model, max_batch_size=3)
    engine.generate_batch = lambda requests: calls.append(len(requests)) or original(requests)
    calls.clear()
    _run(engine, REQUESTS)
    assert calls == [3, 1]


def test_stop_token_is_included_and_ends_the_row(model):
    engine = TransformersEngine(model)
    request = GenerationRequest([5, 40, 41, 42, 7], max_new_tokens=12, temperature=0.7, seed=1)
    free = _run(engine, [request])[0]
    stop_at = free.token_ids[3]
    stopped = _run(
        engine, [GenerationRequest(request.prompt_ids, 12, temperature=0.7, seed=1, stop_token_ids=(stop_at,))]
    )[0]
    cut = free.token_ids.index(stop_at) + 1
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:cut]
    assert stopped.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-6)


def test_unseeded_requests_differ_and_greedy_like_top_k_1(model):
    engine = TransformersEngine(model)
    prompt = [5, 40, 41, 42, 7]
    a, b = _run(engine, [GenerationRequest(prompt, 16), GenerationRequest(prompt, 16)])
    assert a.token_ids != b.token_ids
    greedy = _run(engine, [GenerationRequest(prompt, 6, top_k=1)])[0]
    assert greedy.logprobs == [0.0] * 6  # one surviving token: probability 1
    with torch.no_grad():
        assert greedy.token_ids[0] == int(model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())


def test_bad_requests_are_rejected(model):
    engine = TransformersEngine(model, max_model_len=16)
    with pytest.raises(ValueError, match="exceeds max_model_len=16"):
        _run(engine, [GenerationRequest(list(range(10)), max_new_tokens=7)])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        _run(engine, [GenerationRequest([1, 600], max_new_tokens=2)])


def test_push_weights_is_noop_for_same_model_and_copies_otherwise(model):
    engine = TransformersEngine(tiny_gpt_oss(seed=1))
    request = GenerationRequest([5, 6, 7], max_new_tokens=4, seed=0)
    engine.push_weights(model)
    same_as_model = _run(TransformersEngine(model), [request])[0]
    assert _run(engine, [request])[0].token_ids == same_as_model.token_ids
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, model.get_parameter(name)), name
    engine.push_weights(engine.model)  # no-op
    with pytest.raises(ValueError, match="mlp.experts.gate_up_proj"):
        engine.push_weights(tiny_gpt_oss(seed=0, intermediate_size=64))


def test_push_of_a_peft_model_sends_merged_weights_and_leaves_adapters(model):
    peft = pytest.importorskip("peft")
    trainer = peft.get_peft_model(
        tiny_gpt_oss(seed=0, initializer_range=0.15),
        peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"], init_lora_weights=False),
    )
    ids = torch.tensor([[5, 40, 41, 42, 7]])
    with torch.no_grad():
        before = trainer(input_ids=ids).logits
    engine = TransformersEngine(tiny_gpt_oss(seed=1, initializer_range=0.15))
    engine.push_weights(trainer)
    with torch.no_grad():
        assert torch.allclose(engine.model(input_ids=ids).logits, before, atol=1e-5)  # merged = adapted model
        # adapters unmerged again and still active (PEFT's unmerge subtracts the delta: ulp-level rounding)
        assert torch.allclose(trainer(input_ids=ids).logits, before, atol=1e-5)
    assert not any(getattr(m, "merged", False) for m in trainer.modules())
    q_proj = engine.model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_proj, model.model.layers[0].self_attn.q_proj.weight), "LoRA delta was not merged"
