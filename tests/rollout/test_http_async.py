"""The asyncio HTTP client behind VLLMServerEngine.generate, against small raw servers that answer exactly as
each test needs: body framings, keep-alive reuse and its limits, every way an answer can fail, loop ends."""

import asyncio
import gc
import json
import socket
import threading
import warnings

import pytest

from trl_gptoss.rollout.http_async import AsyncHTTPClient, HTTPTransportError
from trl_gptoss.rollout.server import free_port


class RawServer:
    """A TCP server on 127.0.0.1 whose ``answer(request_head, request_body)`` returns the raw bytes to send
    back (``None``: close without answering); ``keep``: whether to keep reading requests on the connection;
    ``answers_per_connection``: after that many answers, read the next request and close without answering."""

    def __init__(self, answer, *, keep=True, hold: asyncio.Event | None = None, answers_per_connection=None):
        self.answer, self.keep, self.hold, self.limit = answer, keep, hold, answers_per_connection
        self.connections = 0
        self.active = 0
        self.max_active = 0
        self.writers = []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        for writer in self.writers:
            writer.close()
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer):
        self.connections += 1
        self.writers.append(writer)
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(line.split(b":")[1] for line in head.split(b"\r\n") if b"content-length" in line.lower())
                )
                body = await reader.readexactly(length)
                self.active += 1
                self.max_active = max(self.max_active, self.active)
                if self.hold is not None:
                    await self.hold.wait()
                self.active -= 1
                data = None if answered == self.limit else self.answer(head, body)
                if data is None:
                    break
                answered += 1
                writer.write(data)
                await writer.drain()
                if not self.keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes = b'{"ok": true}', extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def echo(head, body):
    return ok(json.dumps({"line": head.split(b"\r\n")[0].decode(), "body": json.loads(body or b"null")}).encode())


def client(url, **kwargs):
    return AsyncHTTPClient(url, connect_timeout=kwargs.pop("connect_timeout", 2.0), max_connections=kwargs.pop("n", 4))


def test_json_round_trip_and_keep_alive_reuse():
    async def go():
        async with RawServer(echo) as server:
            http = client(server.url + "/prefix")
            answers = [await http.request("POST", "/v1/x", {"i": i}, timeout=5) for i in range(5)]
            await http.aclose()
            return server.connections, answers

    connections, answers = asyncio.run(go())
    assert connections == 1, "sequential requests must share one kept-alive connection"
    assert [a.json() for a in answers] == [{"line": "POST /prefix/v1/x HTTP/1.1", "body": {"i": i}} for i in range(5)]
    assert all(a.status == 200 for a in answers)


@pytest.mark.parametrize(
    "raw, keeps",
    [
        (b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;x=1\r\n{"a"\r\n6\r\n: [1]}\r\n0\r\n\r\n', True),
        (ok(b'{"a": [1]}', "Connection: close\r\n"), False),
        (b'HTTP/1.0 200 OK\r\n\r\n{"a": [1]}', False),  # no length: the body ends when the server closes
        (b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b'{"a": [1]}'), True),
    ],
    ids=["chunked", "connection-close", "read-to-eof", "interim-100"],
)
def test_body_framings(raw, keeps):
    async def go():
        async with RawServer(lambda h, b: raw, keep=keeps) as server:
            http = client(server.url)
            answers = [(await http.request("GET", "/", timeout=5)).json() for _ in range(3)]
            await http.aclose()
            return server.connections, answers

    connections, answers = asyncio.run(go())
    assert answers == [{"a": [1]}] * 3
    assert connections == (1 if keeps else 3)


@pytest.mark.parametrize("pause", [0.05, None], ids=["closed-while-idle", "closed-on-next-request"])
def test_kept_connection_closed_by_the_server_is_replaced_silently(pause):
    """The server ends each connection after one answer without saying so, either at once (the client sees the
    close before reusing it) or only when the next request arrives (the client learns it by reading nothing
    back): either way the request goes out on a fresh connection, with no error."""

    async def go():
        async with RawServer(echo, keep=pause is None, answers_per_connection=1) as server:
            http = client(server.url)
            for i in range(4):
                assert (await http.request("POST", "/", {"i": i}, timeout=5)).json()["body"] == {"i": i}
                await asyncio.sleep(pause or 0)
            await http.aclose()
            return server.connections

    assert asyncio.run(go()) == 4


@pytest.mark.parametrize(
    "raw, match",
    [
        (b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"cut', "cut short: 5 of 100 body bytes"),
        (b"HTTP/1.1 200 OK\r\nContent-Le", "closed before the headers were complete"),
        (b"SMTP ready\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "malformed Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"),
        (None, "closed before the headers were complete"),
    ],
    ids=["truncated-body", "truncated-head", "not-http", "bad-length", "bad-chunk", "closed-silently"],
)
def test_broken_answers_are_named_with_the_url(raw, match):
    async def go():
        async with RawServer(lambda h, b: raw, keep=False) as server:
            http = client(server.url)
            with pytest.raises(HTTPTransportError, match=match) as info:
                await http.request("POST", "/v1/completions", {}, timeout=5)
            await http.aclose()
            return server.url, str(info.value)

    url, message = asyncio.run(go())
    assert message.startswith(f"{url}/v1/completions: ")


def test_connection_refused_and_timeouts_are_named():
    url = f"http://127.0.0.1:{free_port()}"

    async def refused():
        with pytest.raises(HTTPTransportError, match=f"{url}/v1/models: cannot connect"):
            await client(url).request("GET", "/v1/models", timeout=5)

    async def silent():
        async with RawServer(echo, hold=asyncio.Event()) as server:  # never answers
            http = client(server.url)
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(HTTPTransportError, match=f"{server.url}/slow: no complete answer within 0.3 s"):
                await http.request("POST", "/slow", {}, timeout=0.3)
            assert loop.time() - started < 2
            await http.aclose()

    asyncio.run(refused())
    asyncio.run(silent())


def test_connections_per_loop_are_bounded_and_a_cancelled_request_closes_its_connection():
    async def go():
        hold = asyncio.Event()
        async with RawServer(echo, hold=hold) as server:
            http = client(server.url, n=2)
            tasks = [asyncio.create_task(http.request("POST", "/", {"i": i}, timeout=10)) for i in range(6)]
            await asyncio.sleep(0.2)
            assert (server.connections, server.max_active) == (2, 2), "more connections than max_connections"
            tasks[0].cancel()
            hold.set()
            answers = await asyncio.gather(*tasks[1:])
            assert [a.json()["body"]["i"] for a in answers] == [1, 2, 3, 4, 5]
            pool = http._pools[asyncio.get_running_loop()]
            assert len(pool.open) <= 2 and all(c.usable() for c in pool.idle)
            await http.aclose()
            return server.connections

    assert asyncio.run(go()) == 3  # the cancelled request's half-used connection was replaced, not reused


def test_loop_end_closes_the_connections_from_any_thread():
    """``asyncio.run`` in a background thread (as the trainer calls run_rollouts): when it returns, the server
    sees every connection closed and nothing is left to warn about."""
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    accepted, closed = [], []

    def serve():
        while len(accepted) < 6:  # 3 per batch, 2 batches
            conn, _ = listener.accept()
            accepted.append(conn)
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    def answer(conn):
        data = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                closed.append(conn)
                return
            data += chunk
            while b"\r\n\r\n" in data:
                data = data.split(b"\r\n\r\n", 1)[1][2:]  # each request has the 2-byte body {}
                conn.sendall(ok())

    threading.Thread(target=serve, daemon=True).start()
    http = client(url, n=3)

    async def batch():
        return await asyncio.gather(*(http.request("POST", "/", {}, timeout=5) for _ in range(3)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            done = []
            worker = threading.Thread(target=lambda done=done: done.append(asyncio.run(batch())))
            worker.start()
            worker.join(10)
            assert len(done[0]) == 3
        gc.collect()
    for _ in range(50):
        if len(closed) == 6:
            break
        threading.Event().wait(0.05)
    assert len(accepted) == 6 and len(closed) == 6, "connections left open after the loop ended"
    assert http._pools == {}
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    for conn in accepted:
        conn.close()
    listener.close()


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="base_url must be http"):
        AsyncHTTPClient("localhost:8000", connect_timeout=1, max_connections=1)
    with pytest.raises(ValueError, match="max_connections must be >= 1"):
        AsyncHTTPClient("http://localhost:8000", connect_timeout=1, max_connections=0)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_cancellation_landing_with_the_answer_is_not_swallowed(framing):
    """The answer arrives and the task is cancelled in the same loop iteration (what Ctrl-C does to a batch whose
    answers sit in the socket buffers): the read must end cancelled. With ``asyncio.wait_for`` (CPython 3.11)
    it returned the answer and the conversation went on with its next turn."""
    from trl_gptoss.rollout.http_async import _read_response

    body = b'{"ok": true}'
    if framing == "chunked":
        raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    else:
        raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    async def main():
        reader = asyncio.StreamReader()
        task = asyncio.create_task(_read_response(reader, "POST", "http://server", stale_ok=False))
        await asyncio.sleep(0)  # the task now waits for the status line
        reader.feed_data(raw)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    asyncio.run(main())


def test_bounded_reads_time_out_pass_results_and_never_swallow_a_cancellation():
    from trl_gptoss.rollout.http_async import within

    async def main():
        assert await within(asyncio.sleep(0, result=7), 1.0) == 7
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(5), 0.05)
        with pytest.raises(ValueError, match="inner"):
            await within(_raise(ValueError("inner")), 1.0)
        reader = asyncio.StreamReader()
        task = asyncio.create_task(within(reader.readuntil(b"\n"), 5.0))
        await asyncio.sleep(0)
        reader.feed_data(b"answer\n")  # the data and the cancellation land in the same loop iteration
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


async def _raise(error):
    raise error
