"""Servers that hold a request, lie about framing or redirect: every client path ends within its one deadline
with an error naming the URL (the asyncio client ``generate`` uses, the blocking engine calls, the ``/health``
probe), caps what it reads, never reads leftover bytes as the next answer and never follows a redirect."""

import asyncio
import time

import pytest

from tests.rollout.hostile_server import HostileServer, answer, forever
from trl_gptoss.rollout.http_async import MAX_INTERIM, MAX_TRAILERS, AsyncHTTPClient, HTTPTransportError
from trl_gptoss.rollout.server import health_status
from trl_gptoss.rollout.types import GenerationRequest
from trl_gptoss.rollout.vllm_engine import VLLMServerEngine, VLLMServerError

DEADLINE = 0.5
SLACK = 1.5  # a loaded 2-core CI machine; the hostile servers below would hold a request for minutes
MODELS = b'{"data": [{"id": "m", "max_model_len": 64}]}'
CHUNKED = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def _interim_forever(number, head):
    yield from forever(b"HTTP/1.1 100 Continue\r\n\r\n", 0.05)


def _trailers_forever(number, head):
    yield (CHUNKED + "2\r\n{}\r\n0\r\n").encode()
    yield from forever(b"X-Trailer: more\r\n", 0.05)


def _body_drip(number, head):
    yield b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"
    yield from forever(b" ", 0.05)


def _head_drip(number, head):
    yield from forever(b"H", 0.05)


def _chunk_drip(number, head):
    yield CHUNKED.encode()
    yield from forever(b"1\r\n \r\n", 0.05)


HOLDS = {
    "interim-100-forever": _interim_forever,
    "trailers-forever": _trailers_forever,
    "body-one-byte-at-a-time": _body_drip,
    "headers-one-byte-at-a-time": _head_drip,
    "chunks-one-byte-at-a-time": _chunk_drip,
}


def _async_call(url):
    async def go():
        client = AsyncHTTPClient(url, connect_timeout=DEADLINE, max_connections=1)
        try:
            await client.request("GET", "/v1/models", timeout=DEADLINE)
        finally:
            await client.aclose()

    with pytest.raises(HTTPTransportError) as info:
        asyncio.run(go())
    return str(info.value)


def _health_call(url):
    error = health_status(url, DEADLINE)
    assert isinstance(error, OSError), error
    return str(error)


def _engine_call(url):
    with pytest.raises(VLLMServerError) as info:
        VLLMServerEngine(url, timeout=DEADLINE, connect_timeout=DEADLINE, max_retries=0)
    return str(info.value)


CALLERS = {"async-client": _async_call, "health-probe": _health_call, "blocking-engine-query": _engine_call}


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("hold", HOLDS)
def test_a_held_request_ends_at_its_deadline_naming_the_url(hold, caller):
    with HostileServer(HOLDS[hold]) as server:
        started = time.monotonic()
        message = CALLERS[caller](server.url)
        elapsed = time.monotonic() - started
    assert server.url in message
    assert elapsed < DEADLINE + SLACK, f"{hold}: held {elapsed:.1f} s past a {DEADLINE} s deadline: {message}"
    if hold == "interim-100-forever":
        assert f"more than {MAX_INTERIM} interim" in message or "within" in message
    if hold == "trailers-forever":
        assert f"more than {MAX_TRAILERS} trailer lines" in message or "within" in message


def test_a_dripping_completion_ends_generate_at_its_deadline():
    """``generate`` (rollouts) against a server that answers the model query and then drips its completions."""

    def script(number, head):
        if head.startswith(b"GET"):
            yield answer(MODELS)
        else:
            yield from _body_drip(number, head)

    with HostileServer(script) as server:
        engine = VLLMServerEngine(server.url, timeout=DEADLINE, max_retries=1, backoff=0.01)
        started = time.monotonic()
        with pytest.raises(VLLMServerError, match=f"{server.url}/v1/completions failed after 2 attempt.*within"):
            asyncio.run(engine.generate(GenerationRequest([1, 2], 2)))
        engine.close()
    assert time.monotonic() - started < 2 * DEADLINE + SLACK


MALFORMED = {
    "latin1-digit-in-status": (b"HTTP/1.1 20\xb2 OK\r\nContent-Length: 2\r\n\r\n{}", "malformed status line"),
    "latin1-digit-in-length": (b"HTTP/1.1 200 OK\r\nContent-Length: 1\xb2\r\n\r\n{}", "malformed Content-Length"),
    "negative-chunk-size": ((CHUNKED + "-5\r\nhello\r\n0\r\n\r\n").encode(), "malformed chunk size"),
    "two-lengths": (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "two different"),
    "huge-length": (b"HTTP/1.1 200 OK\r\nContent-Length: 999999999999\r\n\r\n{}", "over the limit"),
    "huge-chunk": ((CHUNKED + "ffffffffff\r\n").encode(), "over the limit"),
    "switching-protocols": (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switched protocols"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_framing_is_an_error_naming_the_url(case):
    raw, match = MALFORMED[case]
    with HostileServer(lambda number, head: [raw], keep=False) as server:
        message = _async_call(server.url)
    assert message.startswith(f"{server.url}/v1/models: ") and match in message, message


@pytest.mark.parametrize("framing", ["content-length", "chunked", "until-close"])
def test_a_body_over_the_routes_cap_is_refused(framing):
    body = b'{"x": "' + b"a" * 300 + b'"}'
    raw = {
        "content-length": answer(body),
        "chunked": (CHUNKED + "".join(f"40\r\n{'a' * 64}\r\n" for _ in range(5)) + "0\r\n\r\n").encode(),
        "until-close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body,
    }[framing]

    async def go(url):
        client = AsyncHTTPClient(url, connect_timeout=1, max_connections=1)
        with pytest.raises(HTTPTransportError, match=f"{url}/big: .*over the limit of 100 bytes"):
            await client.request("GET", "/big", timeout=2, max_body=100)
        await client.aclose()

    with HostileServer(lambda number, head: [raw], keep=False) as server:
        asyncio.run(go(server.url))


FORGED = answer(b'{"forged": true}')


@pytest.mark.parametrize(
    "first",
    [answer(b"{}") + FORGED, b"HTTP/1.1 204 No Content\r\n\r\n" + FORGED],
    ids=["bytes-past-content-length", "body-after-204"],
)
def test_leftover_bytes_are_never_read_as_the_next_answer(first):
    """The server sends more than its answer declares; the kept connection is dropped, and the next request gets
    its own answer on a fresh one."""

    def script(number, head):
        yield first if number == 0 else answer(b'{"answer": %d}' % number)

    async def go(url):
        client = AsyncHTTPClient(url, connect_timeout=1, max_connections=1)
        await client.request("GET", "/one", timeout=2)
        second = await client.request("GET", "/two", timeout=2)
        await client.aclose()
        return second.json()

    with HostileServer(script) as server:
        assert asyncio.run(go(server.url)) == {"answer": 1}
        assert server.connections == 2


def test_redirects_are_refused_on_both_paths_and_never_followed():
    with HostileServer(lambda number, head: [answer(MODELS)]) as elsewhere:

        def script(number, head):
            if head.startswith(b"GET"):
                yield answer(MODELS)
            else:
                yield answer(b"", "307 Temporary Redirect", f"Location: {elsewhere.url}/v1/completions\r\n")

        with HostileServer(script) as server:
            with pytest.raises(VLLMServerError, match=f"{server.url}/collective_rpc answered HTTP 307, a redirect"):
                engine = VLLMServerEngine(server.url, max_retries=2, backoff=0.01)
                engine.request("POST", "/collective_rpc", {"method": "gptoss_load_weights", "args": []})
            with pytest.raises(VLLMServerError, match=f"{server.url}/v1/completions answered HTTP 307"):
                asyncio.run(engine.generate(GenerationRequest([1, 2], 2)))
            engine.close()
            calls = list(server.requests)
        assert elsewhere.requests == [], "a redirect was followed"
    assert [c.split()[0] for c in calls] == ["GET", "POST", "POST"], "a refused redirect was retried"


def test_one_dripping_server_does_not_stall_a_batch_over_two():
    """A batch spread over two servers, one of which drips its completions: the batch ends at the deadline, the
    good server's answers arrive and the dripping server's requests fail naming it."""
    from trl_gptoss.rollout.multi_server import MultiServerEngine

    good_answer = (
        b'{"choices": [{"finish_reason": "length", "token_ids": [9, 8], '
        b'"logprobs": {"tokens": ["token_id:9", "token_id:8"], "token_logprobs": [-0.5, -0.25]}}]}'
    )

    def good(number, head):
        yield answer(MODELS if head.startswith(b"GET") else good_answer)

    def dripping(number, head):
        yield from ([answer(MODELS)] if head.startswith(b"GET") else _chunk_drip(number, head))

    with HostileServer(good) as fine, HostileServer(dripping) as slow:
        multi = MultiServerEngine([fine.url, slow.url], timeout=DEADLINE, max_retries=0)

        async def batch():
            requests = [GenerationRequest([1, 2, i], 2) for i in range(4)]
            return await asyncio.gather(*(multi.generate(r) for r in requests), return_exceptions=True)

        started = time.monotonic()
        results = asyncio.run(batch())
        elapsed = time.monotonic() - started
        multi.close()
    assert elapsed < DEADLINE + SLACK, f"the batch waited {elapsed:.1f} s for the dripping server"
    assert sum(isinstance(r, VLLMServerError) and slow.url in str(r) for r in results) == 2, results
    assert sum(getattr(r, "token_ids", None) == [9, 8] for r in results) == 2, results
