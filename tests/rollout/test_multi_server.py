"""Several rollout servers: sticky per-conversation routing, spreading, dead entries named, pushes to all."""

import asyncio

import pytest
import requests
import torch
from transformers import GptOssForCausalLM

from tests.rollout.loop_helpers import AddTool, add_call, final, scripted, user
from trl_gptoss.rollout import GenerationRequest, VLLMServerEngine, VLLMServerError
from trl_gptoss.rollout.loop import run_rollouts
from trl_gptoss.rollout.multi_server import MultiServerEngine, PrefixRouter, server_urls
from trl_gptoss.rollout.server import free_port
from trl_gptoss.testing import harmony_tokenizer
from trl_gptoss.trainer.sampling.servers import check_server


def test_router_keeps_a_conversation_on_its_server_and_spreads_new_ones():
    router = PrefixRouter(3)
    first = [router.route([1, 2, 3]) for _ in range(3)]  # three conversations in flight at once
    assert sorted(first) == [0, 1, 2]  # least loaded: one each
    for index, sampled in zip(first, ([10], [20], [30])):
        router.done(index, [1, 2, 3, *sampled])
    # the next turn of each conversation (its prompt extends prompt + sampled tokens) goes back to its server
    for index, sampled in zip(first, ([10], [20], [30])):
        assert router.route([1, 2, 3, *sampled, 7, 8]) == index
    assert router.in_flight == [1, 1, 1]
    assert router.route([9, 9]) in (0, 1, 2) and sorted(router.in_flight) == [1, 1, 2]
    router.forget()  # after a push the servers' caches are empty: no route is remembered
    router.in_flight = [0, 0, 0]
    router.in_flight[first[0]] = 5  # that conversation's old server is now the busiest
    assert router.route([1, 2, 3, 10, 7, 8]) != first[0]


def test_router_forgets_the_oldest_conversations_beyond_its_limit():
    router = PrefixRouter(2, max_entries=2)
    for key in ([1], [2], [3]):
        router.done(router.route(key), key + [0])
    assert len(router._entries) == 2 and (1, 0) not in router._entries


def test_multi_turn_rollouts_stay_on_one_engine_each_and_use_both():
    tok = harmony_tokenizer()
    calls = [2, 1, 3, 0, 2, 1]
    convs = [(user(f"Task {i}"), [add_call(i, k) for k in range(n)] + [final(f"{i}")]) for i, n in enumerate(calls)]
    engines = [scripted(tok, convs, tools=[AddTool()], delay_s=0.01) for _ in range(2)]
    for engine in engines:
        engine.model = "tiny"
    multi = MultiServerEngine.from_engines(engines)
    rollouts = run_rollouts(multi, [c[0] for c in convs], tokenizer=tok, tools=[AddTool()])
    assert [r.stop_reason for r in rollouts] == ["final"] * len(convs)
    served_by = {}
    for index, engine in enumerate(engines):
        for request in engine.requests:
            owner = next(i for i, r in enumerate(rollouts) if request.prompt_ids[: len(r.prompt_ids)] == r.prompt_ids)
            served_by.setdefault(owner, set()).add(index)
    assert all(len(servers) == 1 for servers in served_by.values()), served_by  # sticky per conversation
    assert {next(iter(s)) for s in served_by.values()} == {0, 1}  # both servers used
    assert multi.router.in_flight == [0, 0]


def test_url_lists_and_dead_entries_are_named(vllm_tiny_server):
    dead = f"http://127.0.0.1:{free_port()}"
    assert server_urls(f"{vllm_tiny_server.base_url}, {dead}/") == [vllm_tiny_server.base_url, dead]
    with pytest.raises(ValueError, match="more than once"):
        server_urls([dead, dead + "/"])
    with pytest.raises(ValueError, match=rf"entry '{dead}' does not answer"):
        check_server([vllm_tiny_server.base_url, dead], timeout=2)
    with pytest.raises(VLLMServerError, match=rf"rollout server {dead} is not usable"):
        MultiServerEngine([vllm_tiny_server.base_url, dead], connect_timeout=1, max_retries=0)


SEQUENCE = [5, 40, 41, 42, 7, 300, 301, 17, 99, 100, 101, 250, 251, 3, 480, 9]


def _scores(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQUENCE])).logits[0, :-1]
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(SEQUENCE[1:])[:, None]).squeeze(1)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.xdist_group("vllm")
def test_two_real_servers_each_receive_and_verify_every_push(vllm_tiny_server, tiny_checkpoint):
    from trl_gptoss.testing import vllm_server

    base = GptOssForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation="eager")
    moved = GptOssForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # every parameter group moves (sinks, experts, attention, embeddings, head)
        for param in moved.parameters():
            param.add_(0.3 * max(float(param.std()), 0.1) * torch.randn(param.shape, generator=generator))
    expected = _scores(moved)
    with vllm_server(tiny_checkpoint, max_model_len=1024) as second:
        multi = MultiServerEngine([vllm_tiny_server.base_url, second.base_url], timeout=120)
        try:
            before = [torch.tensor(e.score(SEQUENCE), dtype=torch.float64) for e in multi.engines]
            assert all((b - expected).abs().max() > 1e-3 for b in before)
            multi.push_weights(moved)
            for engine in multi.engines:
                after = torch.tensor(engine.score(SEQUENCE), dtype=torch.float64)
                assert (after - expected).abs().max() <= 1e-4, engine.base_url
                assert engine.pusher().last_push["bytes"] == sum(p.numel() * 4 for p in moved.parameters())
            # eight conversations at once spread over both servers
            requests = [GenerationRequest(SEQUENCE[: 4 + i], max_new_tokens=24, seed=i) for i in range(8)]

            async def sample():
                return await asyncio.gather(*(multi.generate(r) for r in requests))

            counts_before = [_served(e) for e in multi.engines]
            asyncio.run(sample())
            assert all(_served(e) > c for e, c in zip(multi.engines, counts_before)), "a server got no request"
        finally:
            multi.push_weights(base)  # the shared server goes back to its checkpoint for the other tests
            multi.close()


def _served(engine: VLLMServerEngine) -> int:
    """Completion requests the server has finished (its Prometheus counter)."""
    text = requests.get(f"{engine.base_url}/metrics", timeout=10).text
    return int(
        sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:request_success_total"))
    )


def test_urls_are_normalised_once_before_the_duplicate_check():
    assert server_urls("HTTP://LocalHost:08000/, http://127.0.0.1:8001") == [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8001",
    ]
    assert server_urls(["http://[::1]:9", "http://127.0.0.1"]) == ["http://[::1]:9", "http://127.0.0.1:80"]


@pytest.mark.parametrize(
    "urls, match",
    [
        (["http://localhost:8000", "http://127.0.0.1:8000"], "'http://localhost:8000' and 'http://127.0.0.1:8000'"),
        (["HTTP://127.0.0.1:8000", "http://127.0.0.1:8000"], "are both http://127.0.0.1:8000"),
        (["http://127.1:8000", "http://127.0.0.1:8000"], "are both http://127.0.0.1:8000"),
        (["http://127.0.0.1:08000", "http://127.0.0.1:8000"], "are both http://127.0.0.1:8000"),
        ("http://user:secret@127.0.0.1:8000", "carries credentials"),
        ("http://127.0.0.1:8000/v1", "has a path"),
        ("http://127.0.0.1:8000?model=x", "has a query"),
        ("http://127.0.0.1:8000#x", "has a fragment"),
        ("http://127.0.0.1:99999", "not a valid http"),
        ("http://127.0.0.1:0", "port must be an integer in 1-65535"),
        ("http://127.0.0.1:８０", "not a valid http|port must be"),
        ("http://no-such-host.invalid:8000", "'no-such-host.invalid' does not resolve"),
        ("ftp://127.0.0.1:21", "not an http"),
        ("localhost:8000", "not an http"),
        (["http://127.0.0.1:1", " "], "empty entry"),
    ],
    ids=[
        "localhost-vs-ip",
        "scheme-case",
        "short-ip",
        "leading-zero-port",
        "userinfo",
        "path",
        "query",
        "fragment",
        "port-range",
        "port-zero",
        "fullwidth-port",
        "unresolvable",
        "scheme",
        "no-scheme",
        "empty",
    ],
)
def test_refused_urls_name_the_field_and_the_entry(urls, match):
    with pytest.raises(ValueError, match=rf"^rollout_server_url .*({match})"):
        server_urls(urls)
    with pytest.raises(ValueError, match=r"^--server "):
        server_urls(urls, name="--server")
