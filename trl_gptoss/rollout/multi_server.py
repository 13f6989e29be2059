"""Several vLLM servers behind one ``RolloutEngine``: conversations spread, weight pushes reach every server.

Routing: a request that continues a conversation (its prompt starts with an earlier request's prompt plus
that request's sampled tokens) goes to the server that sampled it, so the server's prefix cache holds the
conversation; any other request goes to the server with the fewest requests in flight (ties in turn). A
push goes to every server, each verified on its own (names and shapes before, applied names after), and
forgets the routes: the servers' prefix caches are reset by the push anyway.
"""

from __future__ import annotations

import threading
from collections import Counter

from trl_gptoss.rollout.types import Generation, GenerationRequest
from trl_gptoss.rollout.vllm_engine import VLLMServerEngine, VLLMServerError


class PrefixRouter:
    """Pick a server per request: the one that sampled the conversation so far, else the least loaded.

    ``route(prompt_ids)`` returns a server index and counts the request in flight there; ``done(index,
    continued_ids)`` uncounts it and remembers ``continued_ids`` (prompt + sampled tokens) as that server's.
    At most ``max_entries`` conversations are remembered (the oldest are forgotten first).
    """

    def __init__(self, num_servers: int, max_entries: int = 65536):
        if num_servers < 1:
            raise ValueError(f"PrefixRouter needs at least one server, got {num_servers}")
        self.in_flight = [0] * num_servers
        self.max_entries = max_entries
        self._turn = 0
        self._entries: dict[tuple[int, ...], int] = {}  # insertion order = age
        self._lengths: Counter[int] = Counter()
        self._lock = threading.Lock()

    def route(self, prompt_ids) -> int:
        with self._lock:
            index = self._continued(prompt_ids)
            if index is None:
                least = min(self.in_flight)
                candidates = [i for i, load in enumerate(self.in_flight) if load == least]
                index = candidates[self._turn % len(candidates)]
                self._turn += 1
            self.in_flight[index] += 1
            return index

    def done(self, index: int, continued_ids=None) -> None:
        with self._lock:
            self.in_flight[index] -= 1
            if continued_ids:
                key = tuple(continued_ids)
                if key not in self._entries:
                    self._lengths[len(key)] += 1
                self._entries[key] = index
                while len(self._entries) > self.max_entries:
                    oldest = next(iter(self._entries))
                    del self._entries[oldest]
                    self._forget_length(len(oldest))

    def forget(self) -> None:
        with self._lock:
            self._entries.clear()
            self._lengths.clear()

    def _continued(self, prompt_ids) -> int | None:
        """The server of the longest remembered prefix of ``prompt_ids`` (forgotten: the next turn re-adds)."""
        for length in sorted((n for n in self._lengths if n <= len(prompt_ids)), reverse=True):
            index = self._entries.pop(tuple(prompt_ids[:length]), None)
            if index is not None:
                self._forget_length(length)
                return index
        return None

    def _forget_length(self, length: int) -> None:
        self._lengths[length] -= 1
        if not self._lengths[length]:
            del self._lengths[length]


def server_urls(urls, name: str = "rollout_server_url") -> list[str]:
    """The one normaliser of rollout server URLs (the config's ``rollout_server_url``, ``check-sync --server``):
    one URL, a comma-separated string, or a list, as a list of ``scheme://address:port``. The scheme is lower-cased,
    the host resolved to one address (its first IPv4 one; for ``https`` the lower-case name stays, which its
    certificate names) and the port an integer (80 or 443 when absent). Refused, naming ``name``: empty entries,
    other schemes, credentials in the URL (``user:pass@``: give the server's secret by file or environment), paths
    (the engines add ``/v1/...`` themselves), queries and fragments, a host that does not resolve, and two entries
    for one server however spelled (``localhost`` and ``127.0.0.1``, ``HTTP://``, ``127.1``, port ``08000``): one
    server listed twice would get every push twice and half of nothing."""
    if isinstance(urls, str):
        urls = [u.strip() for u in urls.split(",")]
    if not isinstance(urls, (list, tuple)) or not urls:
        raise ValueError(f"{name} must be a URL or a list of URLs, got {urls!r}")
    normalised, seen = [], {}
    for url in urls:
        if not isinstance(url, str) or not url.strip():
            raise ValueError(f"{name} has an empty entry: {list(urls)!r}")
        canonical, key = normalise_url(url.strip(), name)
        if key in seen:
            if seen[key] == url:
                raise ValueError(f"{name} lists {url!r} more than once; list each server once")
            raise ValueError(
                f"{name} lists one server more than once: {seen[key]!r} and {url!r} are both {canonical}; list each "
                "server once"
            )
        seen[key] = url
        normalised.append(canonical)
    return normalised


def normalise_url(url: str, name: str = "rollout_server_url") -> tuple[str, tuple[str, int]]:
    """``(canonical URL, (address, port))`` of one server URL (see ``server_urls``)."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    example = "e.g. http://127.0.0.1:8000"
    try:
        parts = urlsplit(url)
        port_text = parts.netloc.rpartition("@")[2].rpartition("]")[2].partition(":")[2]
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{name} entry {url!r} is not a valid http(s)://HOST:PORT URL: {exc} ({example})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{name} entry {url!r} is not an http(s)://HOST:PORT URL ({example})")
    if "@" in parts.netloc:
        raise ValueError(
            f"{name} entry {url!r} carries credentials (user:password@): refused; the server's secret goes in "
            "$TRL_GPTOSS_SERVER_SECRET_FILE"
        )
    for part, what in ((parts.path.rstrip("/"), "a path"), (parts.query, "a query"), (parts.fragment, "a fragment")):
        if part or (what != "a path" and url.rstrip("/").endswith(("?", "#"))):
            raise ValueError(f"{name} entry {url!r} has {what}: give the server's root URL only ({example})")
    if port_text and not (port_text.isascii() and port_text.isdigit()) or port == 0:
        raise ValueError(f"{name} entry {url!r}: the port must be an integer in 1-65535")
    port = port or (443 if scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"{name} entry {url!r}: the host {parts.hostname!r} does not resolve ({exc})") from None
    addresses = [info[4][0] for info in infos]
    address = next((a for a in addresses if ipaddress.ip_address(a.split("%")[0]).version == 4), addresses[0])
    host = parts.hostname.lower() if scheme == "https" else (f"[{address}]" if ":" in address else address)
    return f"{scheme}://{host}:{port}", (address, port)


class MultiServerEngine:
    """``RolloutEngine`` over several vLLM servers serving the same model (see the module docstring).

    ``urls``: the servers' base URLs, a list as ``server_urls`` normalised it (the config does, once); ``model``
    and ``engine_kwargs`` go to each ``VLLMServerEngine``. A server that does not answer at construction is an
    error naming it.
    """

    def __init__(self, urls: list[str], model: str | None = None, **engine_kwargs):
        if isinstance(urls, str) or len(set(urls)) != len(urls):
            raise ValueError(f"MultiServerEngine takes a list of distinct URLs (see server_urls), got {urls!r}")
        self.engines: list[VLLMServerEngine] = []
        try:
            for url in urls:
                try:
                    self.engines.append(VLLMServerEngine(url, model, **engine_kwargs))
                except (VLLMServerError, ValueError) as exc:
                    raise VLLMServerError(f"rollout server {url} is not usable: {exc}") from exc
        except BaseException:
            self.close()
            raise
        self._adopt(self.engines)

    @classmethod
    def from_engines(cls, engines) -> MultiServerEngine:
        """Spread over engines that already exist (anything with ``generate``, ``max_model_len`` and, for pushes,
        ``pusher()``)."""
        self = cls.__new__(cls)
        self.engines = list(engines)
        self._adopt(self.engines)
        return self

    def _adopt(self, engines) -> None:
        models = {getattr(e, "model", None) for e in engines}
        if len(models) != 1:
            self.close()
            raise ValueError(f"the rollout servers serve different models: {[e.model for e in engines]}")
        self.model = models.pop()
        self.max_model_len = min(e.max_model_len for e in engines)
        self.router = PrefixRouter(len(engines))

    @property
    def base_urls(self) -> list[str]:
        return [e.base_url for e in self.engines]

    async def generate(self, request: GenerationRequest) -> Generation:
        index = self.router.route(request.prompt_ids)
        generation = None
        try:
            generation = await self.engines[index].generate(request)
            return generation
        finally:
            continued = None if generation is None else list(request.prompt_ids) + list(generation.token_ids)
            self.router.done(index, continued)

    def enable_routes(self):
        """Route capture on every server (``VLLMServerEngine.enable_routes``); they serve one model."""
        shapes = {engine.enable_routes() for engine in self.engines}
        if len(shapes) != 1:
            raise ValueError(f"the rollout servers report different routers: {shapes}")
        return shapes.pop()

    def push_weights(self, model) -> None:
        """Push ``model`` to every server (collective: every rank calls it, rank 0 sends), each verified."""
        from trl_gptoss.rollout.weights import push_model

        push_model(lambda: [e.pusher() for e in self.engines], model)
        self.router.forget()

    def close(self) -> None:
        for engine in self.engines:
            close = getattr(engine, "close", None)
            if callable(close):
                close()
