"""A raw TCP server on 127.0.0.1 that answers each HTTP request with a script: bytes to send and pauses between
them, for the clients' deadlines, caps and checks (real sockets; the clients under test are the real ones)."""

from __future__ import annotations

import contextlib
import socket
import threading


class HostileServer:
    """``script(number, head)`` for the ``number``-th request (from 0, over all connections) with its raw head
    returns an iterable of ``bytes`` (sent at once) and ``float`` (a pause in seconds); when it ends the server
    reads the next request on the connection, or closes it when ``keep`` is false. Use as a context manager;
    ``requests`` lists the request lines received, ``connections`` counts the accepted connections."""

    def __init__(self, script, *, keep: bool = True):
        self.script, self.keep = script, keep
        self.requests: list[str] = []
        self.connections = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]

    def __enter__(self):
        self._threads[0].start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in list(self._threads):
            thread.join(5)
        self._listener.close()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self.connections += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket):
        conn.settimeout(0.05)
        buffer = b""
        with contextlib.closing(conn):
            while not self._stop.is_set():
                head, buffer = self._read_request(conn, buffer)
                if head is None:
                    return
                with self._lock:
                    number = len(self.requests)
                    self.requests.append(head.split(b"\r\n", 1)[0].decode("latin-1"))
                try:
                    for step in self.script(number, head):
                        if isinstance(step, bytes):
                            conn.sendall(step)
                        elif self._stop.wait(step):
                            return
                except OSError:  # the client gave up and closed the connection
                    return
                if not self.keep:
                    return

    def _read_request(self, conn, buffer: bytes):
        """``(head, rest)`` of the next request, its body dropped; ``(None, b"")`` when the connection ends."""
        while b"\r\n\r\n" not in buffer:
            data = self._recv(conn)
            if not data:
                return None, b""
            buffer += data
        head, rest = buffer.split(b"\r\n\r\n", 1)
        length = next(
            (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
            0,
        )
        while len(rest) < length:
            data = self._recv(conn)
            if not data:
                return None, b""
            rest += data
        return head, rest[length:]

    def _recv(self, conn) -> bytes:
        while not self._stop.is_set():
            try:
                return conn.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return b""
        return b""


def answer(body: bytes = b'{"ok": true}', status: str = "200 OK", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def forever(step: bytes, pause: float):
    """``step`` every ``pause`` seconds, without end."""
    while True:
        yield step
        yield pause
