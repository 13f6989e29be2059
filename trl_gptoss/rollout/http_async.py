"""A small asyncio HTTP/1.1 client for JSON calls to one server: keep-alive connections, no threads.

Requests are written and answers read by the event loop that awaits them, so a rollout's engine call needs no
worker thread, and never waits for one (or for the GIL) to carry the request out and the answer back.
Connections belong to the event loop that opened them: each loop gets its own pool of at most
``max_connections`` connections to the server (callers beyond that wait for one to free up), and the pool is
closed when that loop's tasks are cancelled at its end (``asyncio.run`` does this), or by ``aclose()``. A
caller that runs a fresh loop per batch (``run_rollouts`` from any thread) therefore reuses connections within
the batch and leaves none open after it.

Answers are read with ``Content-Length``, ``Transfer-Encoding: chunked`` or until the server closes the
connection. Every failure to get a complete answer (refused or reset connection, no connection within
``connect_timeout``, no data within ``timeout``, an answer cut short, a malformed answer) raises
``HTTPTransportError`` naming the URL; any status code is returned to the caller, which decides about it.
A kept-alive connection that the server closed while idle is replaced once, silently, by a fresh one.

Every read is bounded with ``asyncio.timeout`` (Python 3.10: ``asyncio.wait``), not ``asyncio.wait_for``: on
CPython 3.11 and older, ``wait_for`` returns the inner result when a cancellation lands in the same loop
iteration as the data it was waiting for (gh-86296), so a cancelled rollout went on with its next turn. Under
load that coincidence is common: Ctrl-C during generation left the CPU demo running for a minute, every
conversation whose answer was already in its socket buffer swallowing the cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import sys
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

_HEAD_LIMIT = 64 * 1024  # bytes of status line + headers accepted


async def within(awaitable, seconds: float):
    """``await awaitable``, raising ``TimeoutError`` after ``seconds``; a cancellation of the caller always
    propagates (``asyncio.wait_for`` can swallow it on CPython < 3.12, see the module docstring)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await within_by_wait(awaitable, seconds)  # 3.10 has no asyncio.timeout


async def within_by_wait(awaitable, seconds: float):
    """``within`` for Python 3.10: ``asyncio.wait`` never swallows the caller's cancellation; the inner task is
    cancelled and awaited before this returns or raises, so nothing keeps reading the connection."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise asyncio.TimeoutError
    return task.result()


class HTTPTransportError(ConnectionError):
    """No complete HTTP answer came back from the URL in the message (the reason follows it)."""


@dataclass(frozen=True)
class Response:
    status: int
    reason: str
    body: bytes

    def json(self):
        """The decoded JSON body, ``None`` when the body is empty."""
        return json.loads(self.body) if self.body else None

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class _Stale(Exception):
    """A reused connection was closed by the server before any byte of the answer arrived."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        return not (self.writer.is_closing() or self.reader.at_eof())

    def close(self) -> None:
        self.writer.close()


class _Pool:
    """The connections of one event loop: idle ones for reuse, and a bound on how many exist at once."""

    def __init__(self, limit: int):
        self.slots = asyncio.Semaphore(limit)
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()
        self.closed = False
        self.closer: asyncio.Task | None = None

    def discard(self, conn: _Connection) -> None:
        self.open.discard(conn)
        conn.close()

    async def close(self) -> None:
        conns = self.close_nowait()
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.writer.wait_closed()

    def close_nowait(self) -> list[_Connection]:
        """Close every connection (the sockets go once the loop runs again); returns them."""
        self.closed = True
        conns, self.idle = list(self.open), []
        self.open.clear()
        for conn in conns:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                conn.close()
        return conns


class AsyncHTTPClient:
    """JSON over HTTP/1.1 to ``base_url`` (``http://host:port[/prefix]`` or ``https://...``).

    ``connect_timeout``: seconds to open a connection; ``max_connections``: connections per event loop (and so
    requests in flight from one loop). The read timeout is given per request: the longest wait for the next
    piece of the answer (the first piece, the status line, comes when the server has finished the work).
    """

    def __init__(self, base_url: str, *, connect_timeout: float, max_connections: int):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be http://host:port or https://host:port, got {base_url!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.base_url = base_url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        default_port = parts.port is None or parts.port == (443 if parts.scheme == "https" else 80)
        self.host_header = parts.netloc.rsplit("@", 1)[-1] if not default_port else self.host
        self.connect_timeout, self.max_connections = connect_timeout, max_connections
        self._pools: dict[asyncio.AbstractEventLoop, _Pool] = {}
        self._lock = threading.Lock()

    # -- public -----------------------------------------------------------------------------------------
    async def request(self, method: str, path: str, payload=None, *, timeout: float) -> Response:
        """Send one request (``payload`` JSON-encoded when given) and read the whole answer."""
        url = f"{self.base_url}{path}"
        body = b"" if payload is None else json.dumps(payload).encode()
        head = self._head(method, path, body, payload is not None)
        pool = self._pool()
        async with pool.slots:
            while pool.idle:
                conn = pool.idle.pop()
                if not conn.usable():
                    pool.discard(conn)
                    continue
                try:
                    return await self._exchange(pool, conn, head + body, method, url, timeout, reused=True)
                except _Stale:
                    continue  # the server dropped it while idle; try the next idle one or a fresh one
            conn = await self._connect(pool, url)
            return await self._exchange(pool, conn, head + body, method, url, timeout, reused=False)

    async def aclose(self) -> None:
        """Close the running loop's connections (a later request opens new ones)."""
        with self._lock:
            pool = self._pools.pop(asyncio.get_running_loop(), None)
        if pool is not None:
            await pool.close()

    def close(self) -> None:
        """Close the connections of every loop still running (from any thread); forget finished loops."""
        with self._lock:
            pools, self._pools = dict(self._pools), {}
        for loop, pool in pools.items():
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(lambda p=pool: asyncio.ensure_future(p.close()))

    # -- connections ------------------------------------------------------------------------------------
    def _pool(self) -> _Pool:
        loop = asyncio.get_running_loop()
        with self._lock:
            for stale in [other for other in self._pools if other.is_closed()]:
                del self._pools[stale]  # a loop closed without cancelling its tasks: nothing can run there now
            pool = self._pools.get(loop)
            if pool is None or pool.closed:
                pool = self._pools[loop] = _Pool(self.max_connections)
                # held by the pool: the loop itself keeps only a weak reference to its tasks
                pool.closer = loop.create_task(self._close_at_loop_end(loop, pool), name=f"http-pool {self.base_url}")
        return pool

    async def _close_at_loop_end(self, loop, pool: _Pool) -> None:
        """Sleeps until cancelled (``asyncio.run`` cancels every task before closing its loop), then closes the
        pool. Destroyed without being cancelled (a loop dropped with the task pending), it closes what it can
        without awaiting."""
        try:
            await loop.create_future()
        except asyncio.CancelledError:
            self._forget(loop, pool)
            await pool.close()
            raise
        finally:
            self._forget(loop, pool)
            pool.close_nowait()

    def _forget(self, loop, pool: _Pool) -> None:
        with self._lock:
            if self._pools.get(loop) is pool:
                del self._pools[loop]

    async def _connect(self, pool: _Pool, url: str) -> _Connection:
        try:
            reader, writer = await within(
                asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=_HEAD_LIMIT),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise HTTPTransportError(f"{url}: no connection within {self.connect_timeout} s") from None
        except OSError as exc:
            raise HTTPTransportError(f"{url}: cannot connect: {exc}") from exc
        conn = _Connection(reader, writer)
        pool.open.add(conn)
        return conn

    def _head(self, method: str, path: str, body: bytes, is_json: bool) -> bytes:
        lines = [
            f"{method} {self.prefix}{path} HTTP/1.1",
            f"Host: {self.host_header}",
            "Accept: application/json",
            "Connection: keep-alive",
            f"Content-Length: {len(body)}",
        ]
        if is_json:
            lines.append("Content-Type: application/json")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _exchange(self, pool, conn: _Connection, data: bytes, method: str, url: str, timeout: float, *, reused):
        """Write the request on ``conn`` and read the answer; the connection goes back to the pool only when the
        answer was read completely and both sides allow reuse, and is closed on any failure or cancellation."""
        try:
            try:
                conn.writer.write(data)
                await conn.writer.drain()
            except OSError as exc:
                if reused:
                    raise _Stale() from None
                raise HTTPTransportError(f"{url}: connection failed while sending the request: {exc}") from exc
            response, keep = await _read_response(conn.reader, method, timeout, url, stale_ok=reused)
        except BaseException:
            pool.discard(conn)
            raise
        if keep and not pool.closed:
            pool.idle.append(conn)
        else:
            pool.discard(conn)
        return response


async def _read_response(reader, method: str, timeout: float, url: str, *, stale_ok: bool):
    """``(Response, reusable)`` from ``reader``; raises ``HTTPTransportError`` (``_Stale`` when ``stale_ok`` and
    the connection ended before any byte of the answer)."""
    first = True
    while True:
        try:
            head = await within(reader.readuntil(b"\r\n\r\n"), timeout)
        except asyncio.TimeoutError:
            raise HTTPTransportError(f"{url}: no answer within {timeout} s") from None
        except asyncio.IncompleteReadError as exc:
            if first and stale_ok and not exc.partial:
                raise _Stale() from None
            raise HTTPTransportError(f"{url}: the connection closed before the headers were complete") from None
        except asyncio.LimitOverrunError:
            raise HTTPTransportError(f"{url}: answer headers longer than {_HEAD_LIMIT} bytes") from None
        except OSError as exc:
            if first and stale_ok:
                raise _Stale() from None
            raise HTTPTransportError(f"{url}: connection failed while waiting for the answer: {exc}") from exc
        first = False
        version, status, reason, headers = _parse_head(head, url)
        if not 100 <= status < 200:
            break  # 1xx interim answers are skipped
    keep = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    if method == "HEAD" or status in (204, 304):
        return Response(status, reason, b""), keep
    try:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await _read_chunked(reader, timeout, url)
        elif "content-length" in headers:
            body = await within(reader.readexactly(_length(headers["content-length"], url)), timeout)
        else:
            body, keep = await within(reader.read(), timeout), False  # until the server closes
    except asyncio.TimeoutError:
        raise HTTPTransportError(f"{url}: the answer stalled for {timeout} s (HTTP {status})") from None
    except asyncio.LimitOverrunError:
        raise HTTPTransportError(f"{url}: a chunk header longer than {_HEAD_LIMIT} bytes") from None
    except asyncio.IncompleteReadError as exc:
        raise HTTPTransportError(
            f"{url}: the answer (HTTP {status}) was cut short: {len(exc.partial)} of {exc.expected} body bytes"
        ) from None
    except OSError as exc:
        raise HTTPTransportError(f"{url}: connection failed while reading the answer (HTTP {status}): {exc}") from exc
    return Response(status, reason, body), keep


def _parse_head(head: bytes, url: str) -> tuple[str, int, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise HTTPTransportError(f"{url}: malformed status line {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise HTTPTransportError(f"{url}: malformed header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
    return parts[0], int(parts[1]), parts[2] if len(parts) > 2 else "", headers


def _length(value: str, url: str) -> int:
    if not value.isdigit():
        raise HTTPTransportError(f"{url}: malformed Content-Length {value[:40]!r}")
    return int(value)


async def _read_chunked(reader, timeout: float, url: str) -> bytes:
    pieces = []
    while True:
        line = await within(reader.readuntil(b"\r\n"), timeout)
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HTTPTransportError(f"{url}: malformed chunk size {size_text[:20]!r}") from None
        if size == 0:
            while await within(reader.readuntil(b"\r\n"), timeout) != b"\r\n":
                pass  # trailers
            return b"".join(pieces)
        pieces.append(await within(reader.readexactly(size + 2), timeout))
        if not pieces[-1].endswith(b"\r\n"):
            raise HTTPTransportError(f"{url}: a chunk did not end with CRLF")
        pieces[-1] = pieces[-1][:-2]
