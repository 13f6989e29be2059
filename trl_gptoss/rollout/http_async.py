"""A small asyncio HTTP/1.1 client for JSON calls to one server: keep-alive connections, no threads.

Requests are written and answers read by the event loop that awaits them, so a rollout's engine call needs no
worker thread, and never waits for one (or for the GIL) to carry the request out and the answer back.
Connections belong to the event loop that opened them: each loop gets its own pool of at most
``max_connections`` connections to the server (callers beyond that wait for one to free up), and the pool is
closed when that loop's tasks are cancelled at its end (``asyncio.run`` does this), or by ``aclose()``. A
caller that runs a fresh loop per batch (``run_rollouts`` from any thread) therefore reuses connections within
the batch and leaves none open after it.

Answers are read with ``Content-Length``, ``Transfer-Encoding: chunked`` or until the server closes the
connection. One deadline, ``timeout``, bounds the whole request from the moment it has a connection slot:
connecting (also bounded by ``connect_timeout``), sending, the status line and headers, interim ``1xx`` answers
(at most ``MAX_INTERIM``), every chunk, the trailers (at most ``MAX_TRAILERS`` lines) and the body (at most
``max_body`` bytes). A server that drips its answer a byte at a time, or sends ``100 Continue`` forever, ends
the request at the deadline like one that sends nothing. Every failure to get a complete answer (refused or
reset connection, the deadline, an answer cut short, a malformed or oversized one) raises
``HTTPTransportError`` naming the URL; any status code is returned to the caller, which decides about it
(redirects are never followed here). Numbers in the status line, ``Content-Length`` and chunk sizes are ASCII
digits only. A connection goes back to the pool only when nothing is left unread on it (bytes past the
declared body, a body after a ``204``): such bytes would be read as the answer to the next request. A
kept-alive connection that the server closed while idle is replaced once, silently, by a fresh one.

The deadline is ``asyncio.timeout``, not ``asyncio.wait_for``: on CPython 3.11
and older, ``wait_for`` returns the inner result when a cancellation lands in the same loop iteration as the data
it was waiting for (gh-86296), so a cancelled rollout went on with its next turn. Under load that coincidence is
common: Ctrl-C during generation left the CPU demo running for a minute, every conversation whose answer was
already in its socket buffer swallowing the cancellation.

``request_blocking`` runs one request from code without an event loop (the start-up query, ``/health``, weight
pushes, scores) on a private loop: the blocking paths get the same deadline and checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_HEAD_LIMIT = 64 * 1024  # bytes of status line + headers accepted (and of one chunk-size or trailer line)
MAX_INTERIM = 8  # 1xx interim answers accepted before the final one
MAX_TRAILERS = 32  # trailer lines accepted after the last chunk
DEFAULT_MAX_BODY = 64 * 2**20  # bytes of one answer's body, unless the request gives its own bound
_HEX = frozenset("0123456789abcdefABCDEF")


async def within(awaitable, seconds: float):
    """``await awaitable``, raising ``TimeoutError`` after ``seconds``; a cancellation of the caller always
    propagates (``asyncio.wait_for`` can swallow it on CPython 3.11, see the module docstring)."""
    async with asyncio.timeout(seconds):
        return await awaitable


class HTTPTransportError(ConnectionError):
    """No complete HTTP answer came back from the URL in the message (the reason follows it)."""


@dataclass(frozen=True)
class Response:
    status: int
    reason: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names

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
        return not (self.writer.is_closing() or self.reader.at_eof() or _unread(self.reader))

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
    requests in flight from one loop); ``headers``: sent with every request (e.g. ``Authorization``). The
    deadline is given per request: the longest the whole request may take once it has a connection slot.
    """

    def __init__(self, base_url: str, *, connect_timeout: float, max_connections: int, headers=None):
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
        self.headers = {str(k): str(v) for k, v in (headers or {}).items()}
        if any(c in "\r\n" for item in self.headers.items() for c in "".join(item)):
            raise ValueError("headers must not contain line breaks")
        self._pools: dict[asyncio.AbstractEventLoop, _Pool] = {}
        self._lock = threading.Lock()

    # -- public -----------------------------------------------------------------------------------------
    async def request(
        self, method: str, path: str, payload=None, *, timeout: float, max_body: int = DEFAULT_MAX_BODY
    ) -> Response:
        """Send one request (``payload`` JSON-encoded when given) and read the whole answer within ``timeout``
        seconds (see the module docstring); a body over ``max_body`` bytes is an error."""
        url = f"{self.base_url}{path}"
        body = b"" if payload is None else json.dumps(payload).encode()
        data = self._head(method, path, body, payload is not None) + body
        pool = self._pool()
        async with pool.slots:
            try:
                return await within(self._send(pool, data, method, url, max_body), timeout)
            except TimeoutError:
                raise HTTPTransportError(f"{url}: no complete answer within {timeout} s") from None

    async def _send(self, pool: _Pool, data: bytes, method: str, url: str, max_body: int) -> Response:
        """``data`` on an idle connection, or on a fresh one when none is left (or the idle ones were stale)."""
        while pool.idle:
            conn = pool.idle.pop()
            if not conn.usable():
                pool.discard(conn)
                continue
            try:
                return await self._exchange(pool, conn, data, method, url, max_body, reused=True)
            except _Stale:
                continue  # the server dropped it while idle; try the next idle one or a fresh one
        conn = await self._connect(pool, url)
        return await self._exchange(pool, conn, data, method, url, max_body, reused=False)

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
        except TimeoutError:
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
            *(f"{name}: {value}" for name, value in self.headers.items()),
        ]
        if is_json:
            lines.append("Content-Type: application/json")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _exchange(self, pool, conn: _Connection, data: bytes, method: str, url: str, max_body: int, *, reused):
        """Write the request on ``conn`` and read the answer; the connection goes back to the pool only when the
        answer was read completely, nothing more is waiting on it and both sides allow reuse; it is closed on any
        failure or cancellation (the deadline's included)."""
        try:
            try:
                conn.writer.write(data)
                await conn.writer.drain()
            except OSError as exc:
                if reused:
                    raise _Stale() from None
                raise HTTPTransportError(f"{url}: connection failed while sending the request: {exc}") from exc
            response, keep = await _read_response(conn.reader, method, url, stale_ok=reused, max_body=max_body)
        except BaseException:
            pool.discard(conn)
            raise
        if keep and not pool.closed and not _unread(conn.reader):
            pool.idle.append(conn)
        else:
            pool.discard(conn)
        return response


def _unread(reader: asyncio.StreamReader) -> int:
    """Bytes received on the connection and not read (``StreamReader`` keeps them in ``_buffer``; there is no
    public accessor)."""
    return len(getattr(reader, "_buffer", b""))


async def _read_response(reader, method: str, url: str, *, stale_ok: bool, max_body: int = DEFAULT_MAX_BODY):
    """``(Response, reusable)`` from ``reader``; raises ``HTTPTransportError`` (``_Stale`` when ``stale_ok`` and
    the connection ended before any byte of the answer). Unbounded in time: the caller's deadline bounds it."""
    status = None
    try:
        version, status, reason, headers = await _read_head(reader, url, stale_ok=stale_ok)
        keep = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        if method == "HEAD" or status in (204, 304):
            return Response(status, reason, b"", headers), keep
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await _read_chunked(reader, url, max_body)
        elif "content-length" in headers:
            body = await reader.readexactly(_content_length(headers["content-length"], url, max_body))
        else:
            body, keep = await _read_to_close(reader, url, max_body), False
    except asyncio.LimitOverrunError:
        raise HTTPTransportError(f"{url}: a header, chunk-size or trailer line over {_HEAD_LIMIT} bytes") from None
    except asyncio.IncompleteReadError as exc:
        if status is None:
            raise HTTPTransportError(f"{url}: the connection closed before the headers were complete") from None
        raise HTTPTransportError(
            f"{url}: the answer (HTTP {status}) was cut short: {len(exc.partial)} of {exc.expected} body bytes"
        ) from None
    except OSError as exc:
        if isinstance(exc, HTTPTransportError):
            raise
        where = "waiting for the answer" if status is None else f"reading the answer (HTTP {status})"
        raise HTTPTransportError(f"{url}: connection failed while {where}: {exc}") from exc
    return Response(status, reason, body, headers), keep


async def _read_head(reader, url: str, *, stale_ok: bool):
    """The final answer's ``(version, status, reason, headers)``, skipping at most ``MAX_INTERIM`` 1xx answers."""
    for interim in range(MAX_INTERIM + 1):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if interim == 0 and stale_ok and not exc.partial:
                raise _Stale() from None
            raise
        except OSError:
            if interim == 0 and stale_ok:
                raise _Stale() from None
            raise
        version, status, reason, headers = _parse_head(head, url)
        if status == 101:
            raise HTTPTransportError(f"{url}: the server switched protocols (HTTP 101); expected an HTTP answer")
        if not 100 <= status < 200:
            return version, status, reason, headers
    raise HTTPTransportError(f"{url}: more than {MAX_INTERIM} interim (1xx) answers before the final one")


def _ascii_digits(text: str) -> bool:
    """``str.isdigit`` accepts other scripts' digits (``'²'``, ``'٣'``) that ``int`` then refuses or reads."""
    return bool(text) and text.isascii() and text.isdigit()


def _parse_head(head: bytes, url: str) -> tuple[str, int, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or parts[0] not in ("HTTP/1.0", "HTTP/1.1") or len(parts[1]) != 3 or not _ascii_digits(parts[1]):
        raise HTTPTransportError(f"{url}: malformed status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep or not name.strip():
                raise HTTPTransportError(f"{url}: malformed header line {line[:80]!r}")
            name, value = name.strip().lower(), value.strip()
            if name in ("content-length", "transfer-encoding") and headers.get(name, value) != value:
                raise HTTPTransportError(f"{url}: two different {name} headers")
            headers[name] = value
    return parts[0], int(parts[1]), parts[2] if len(parts) > 2 else "", headers


def _content_length(value: str, url: str, max_body: int) -> int:
    if not _ascii_digits(value):
        raise HTTPTransportError(f"{url}: malformed Content-Length {value[:40]!r}")
    length = int(value)
    if length > max_body:
        raise HTTPTransportError(f"{url}: an answer body of {length} bytes is over the limit of {max_body} bytes")
    return length


async def _read_to_close(reader, url: str, max_body: int) -> bytes:
    pieces, size = [], 0
    while piece := await reader.read(65536):
        size += len(piece)
        if size > max_body:
            raise HTTPTransportError(f"{url}: the answer body grew over the limit of {max_body} bytes")
        pieces.append(piece)
    return b"".join(pieces)


async def _read_chunked(reader, url: str, max_body: int) -> bytes:
    pieces, size = [], 0
    while True:
        line = await reader.readuntil(b"\r\n")
        size_text = line.split(b";", 1)[0].strip().decode("latin-1")
        if not size_text or len(size_text) > 16 or not set(size_text) <= _HEX:
            raise HTTPTransportError(f"{url}: malformed chunk size {size_text[:20]!r}")
        chunk = int(size_text, 16)
        if chunk == 0:
            for _ in range(MAX_TRAILERS + 1):
                if await reader.readuntil(b"\r\n") == b"\r\n":
                    return b"".join(pieces)
            raise HTTPTransportError(f"{url}: more than {MAX_TRAILERS} trailer lines after the last chunk")
        size += chunk
        if size > max_body:
            raise HTTPTransportError(f"{url}: the chunked answer body grew over the limit of {max_body} bytes")
        piece = await reader.readexactly(chunk + 2)
        if not piece.endswith(b"\r\n"):
            raise HTTPTransportError(f"{url}: a chunk did not end with CRLF")
        pieces.append(piece[:-2])


def request_blocking(client: AsyncHTTPClient, method: str, path: str, payload=None, **kwargs) -> Response:
    """``client.request(...)`` from code that is not in an event loop, on a private one (closed afterwards with
    its connections); from inside a running loop, on a helper thread (the caller blocks either way)."""
    from trl_gptoss.rollout.event_loop import run_blocking

    return run_blocking(lambda: client.request(method, path, payload, **kwargs))
