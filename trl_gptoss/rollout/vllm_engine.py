"""Rollout engine that samples from a vLLM server over HTTP: token-id prompts in, token ids + log-probs out.

Every process (each rank of a training job) talks to the server itself; nothing is gathered to rank 0 and no
process assumes anything about the others, so processes that make different numbers of tool calls never
exchange continuations. ``generate`` (what rollouts await) sends its request from the event loop itself over
kept-alive connections (``http_async``), so no thread carries requests out and back; the blocking calls
(``generate_sync``, ``score``, the start-up query, weight pushes) run the same client on a private loop. Both
paths give every call one deadline for the whole answer (``http_async``), send the run's server secret
(``server_secret``) and check every answer (``server_answers``); they retry with exponential backoff on
connection errors, deadlines, cut-short answers, 5xx answers and, for calls that change nothing on the server,
malformed answers. A redirect is refused, never followed. Every error names the server's URL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from trl_gptoss.rollout import server_answers
from trl_gptoss.rollout.http_async import AsyncHTTPClient, HTTPTransportError
from trl_gptoss.rollout.routes import EVICTED, RouteShape, new_tag_key, parse_routes, route_tag
from trl_gptoss.rollout.server_answers import MalformedAnswer, VLLMServerError
from trl_gptoss.rollout.server_secret import auth_headers, check_secret, secret_from_environment
from trl_gptoss.rollout.types import Generation, GenerationRequest

logger = logging.getLogger(__name__)


def completion_payload(model: str, request: GenerationRequest) -> dict:
    """``/v1/completions`` body for one request: token-id prompt, sampled-token log-probs, only the request's
    stop ids end sampling (``ignore_eos``: the in-process engine follows the same rule)."""
    payload = {
        "model": model,
        "prompt": [int(t) for t in request.prompt_ids],
        "max_tokens": request.max_new_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "n": 1,
        "logprobs": 0,
        "stop_token_ids": [int(t) for t in request.stop_token_ids],
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if request.seed is not None:
        payload["seed"] = int(request.seed)
    return payload


def generation_from_choice(choice: dict, *, vocab_size: int | None = None) -> Generation:
    """Parse one ``choices[i]`` of a completions answer (``server_answers.generation``: both token-id sources
    agree, ids in ``[0, vocab_size)``, finite log-probs <= 0); a ``VLLMServerError`` naming the field when not."""
    try:
        return server_answers.generation(choice, vocab_size=vocab_size)
    except MalformedAnswer as exc:
        raise VLLMServerError(f"vLLM sent a malformed completion: {exc}") from None


class VLLMServerEngine:
    """``RolloutEngine`` backed by a running vLLM server (``trl-gptoss vllm-serve`` or ``VLLMServer``).

    ``model``: the served model id (default: the only one ``/v1/models`` lists). ``timeout``: the deadline of one
    HTTP call in seconds, connecting and the whole answer included; ``connect_timeout`` for opening a connection;
    ``max_retries`` extra attempts, ``backoff * 2**i`` seconds apart. A call therefore fails within about
    ``(max_retries + 1) * timeout + backoff * (2**max_retries - 1)`` seconds. ``max_concurrency``: ``generate``
    requests in flight at once from one event loop (its connections to the server); more wait for a free
    connection. ``secret``: the server's secret (``server_secret``; default: from the environment, ``None``
    when none is set there); ``vocab_size``: token ids the server sends must be below it (the policy's vocabulary).
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_concurrency: int = 64,
        secret: str | None = None,
        vocab_size: int | None = None,
    ):
        if max_retries < 0 or not 0 < timeout < float("inf") or not 0 < connect_timeout < float("inf"):
            raise ValueError("max_retries must be >= 0 and the timeouts finite and > 0")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.base_url = base_url.rstrip("/")
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.max_retries, self.backoff = max_retries, backoff
        self.vocab_size = vocab_size
        secret = secret_from_environment() if secret is None else check_secret(secret, "secret")
        headers = auth_headers(secret)
        self._http = AsyncHTTPClient(
            self.base_url, connect_timeout=connect_timeout, max_connections=max_concurrency, headers=headers
        )
        served = self.request("GET", "/v1/models", check=server_answers.served_models)
        if model is None and len(served) != 1:
            raise ValueError(f"{self.base_url} serves {[m['id'] for m in served]}; pass model=")
        entry = served[0] if model is None else next((m for m in served if m["id"] == model), None)
        if entry is None:
            raise ValueError(f"{self.base_url} does not serve {model!r}; it serves {[m['id'] for m in served]}")
        self.model = entry["id"]
        self.max_model_len = entry["max_model_len"]
        self._weight_sync = None
        self.route_shape: RouteShape | None = None  # set by enable_routes
        self._tag_key: bytes | None = None  # this client's key for the tags of its requests (enable_routes)
        self.routes_evicted = 0  # requests whose routes the server dropped before they were taken

    # -- HTTP -------------------------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        payload: dict | None = None,
        *,
        timeout: float | None = None,
        retries: int | None = None,
        check=None,
    ):
        """One blocking JSON call: ``arequest`` on a private event loop (``event_loop.run_blocking``), from any
        thread."""
        from trl_gptoss.rollout.event_loop import run_blocking

        return run_blocking(lambda: self.arequest(method, path, payload, timeout=timeout, retries=retries, check=check))

    async def arequest(
        self,
        method: str,
        path: str,
        payload: dict | None = None,
        *,
        timeout: float | None = None,
        retries: int | None = None,
        check=None,
    ):
        """One JSON call from the running event loop with ``retries`` retries (default ``max_retries``; 0 for calls
        that must not be repeated, e.g. one coupled to an NCCL broadcast). Returns the decoded body (``None`` when
        empty), or ``check(body)`` when given: a ``MalformedAnswer`` it raises is retried like a 5xx answer (give
        ``check`` only for calls that change nothing on the server)."""
        url = f"{self.base_url}{path}"
        last_error = None
        attempts = (self.max_retries if retries is None else retries) + 1
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = await self._http.request(method, path, payload, timeout=timeout or self.timeout)
            except HTTPTransportError as exc:
                last_error = str(exc)
                continue
            last_error = _server_error(url, response)
            if last_error is not None:
                continue
            try:
                body = response.json()
                return body if check is None else check(body)
            except MalformedAnswer as exc:
                last_error = f"malformed answer: {exc}"
            except ValueError:
                last_error = f"answered HTTP {response.status} with a body that is not JSON: {response.text[:200]!r}"
                if check is None:
                    raise VLLMServerError(f"vLLM server at {url} {last_error}") from None
        raise VLLMServerError(f"vLLM server at {url} failed after {attempts} attempt(s): {last_error}")

    def health(self) -> bool:
        """``True`` when ``/health`` answers 200 within ``connect_timeout`` (no retries)."""
        from trl_gptoss.rollout.server import health_status

        return health_status(self.base_url, self.connect_timeout) == 200

    def score(self, token_ids) -> list[float]:
        """The served model's log-prob of each token of ``token_ids`` given the ones before it (temperature 1):
        ``len(token_ids) - 1`` values, what a weight-sync check compares with the trainer's recomputation."""
        token_ids = [int(t) for t in token_ids]
        if len(token_ids) < 2:
            raise ValueError(f"score needs at least 2 token ids (the first has no prefix), got {len(token_ids)}")
        payload = {
            "model": self.model,
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        return self.request(
            "POST", "/v1/completions", payload, check=lambda answer: server_answers.prompt_logprobs(answer, token_ids)
        )

    # -- RolloutEngine ----------------------------------------------------------------------------------
    def _generation_check(self, request: GenerationRequest):
        def check(answer) -> Generation:
            choice = server_answers.only_choice(answer)
            return server_answers.generation(choice, vocab_size=self.vocab_size, max_tokens=request.max_new_tokens)

        return check

    def generate_sync(self, request: GenerationRequest) -> Generation:
        request.check_fits(self.max_model_len)
        payload = completion_payload(self.model, request)
        return self.request("POST", "/v1/completions", payload, check=self._generation_check(request))

    async def generate(self, request: GenerationRequest) -> Generation:
        request.check_fits(self.max_model_len)
        payload = completion_payload(self.model, request)
        if self.route_shape is not None:
            payload["request_id"] = tag = route_tag(self._tag_key)  # the worker keeps the routes of tagged requests
        generation = await self.arequest("POST", "/v1/completions", payload, check=self._generation_check(request))
        if self.route_shape is None:
            return generation
        return await self._with_routes(generation, tag, [*request.prompt_ids, *generation.token_ids])

    # -- routes (R3) ------------------------------------------------------------------------------------
    def enable_routes(self) -> RouteShape:
        """Ask the server's workers to capture every router's experts (``vllm_worker/gptoss_vllm_routes.py``);
        from now on each ``generate`` also fetches its request's routes (``Generation.routes``). Returns the
        served model's route shape."""
        from trl_gptoss.rollout.weights.server_calls import collective_rpc

        self._tag_key = self._tag_key or new_tag_key()
        answers = collective_rpc(self, "gptoss_enable_routes", self._tag_key.hex())
        shapes = {RouteShape.from_answer(answer) for answer in answers}
        if len(shapes) != 1:
            raise VLLMServerError(f"vLLM server at {self.base_url}: its workers report different routers {shapes}")
        self.route_shape = shapes.pop()
        return self.route_shape

    def disable_routes(self) -> None:
        """Stop route capture on the server, for every client of it (this engine's ``generate`` returns no routes
        from now on; another client's requests lose theirs too)."""
        from trl_gptoss.rollout.weights.server_calls import collective_rpc

        collective_rpc(self, "gptoss_disable_routes")
        self.route_shape = None

    async def _with_routes(self, generation: Generation, tag: str, token_ids: list[int]) -> Generation:
        payload = {"method": "gptoss_take_routes", "args": [tag]}
        answer = await self.arequest("POST", "/collective_rpc", payload, retries=0, check=server_answers.rpc_results)
        routes, note = parse_routes(answer[0], self.route_shape, token_ids)  # workers of one engine route alike
        if note == EVICTED:
            self.routes_evicted += 1
            if self.routes_evicted & (self.routes_evicted - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... time
                logger.warning(
                    "vLLM server at %s dropped the routes of %d request(s) so far before they were taken (its route "
                    "store was full); those positions replay the trainer's own router (routing_replay falls back)",
                    self.base_url,
                    self.routes_evicted,
                )
        return dataclasses.replace(generation, routes=routes, routes_note=note)

    async def aclose(self) -> None:
        """Close the running event loop's connections now (they are closed anyway when the loop ends)."""
        await self._http.aclose()

    def pusher(self):
        """This server's weight pusher (HTTP on CPU, NCCL on GPU), built on first use (it reads the served
        layout and, on GPU, joins the server's transfer group)."""
        from trl_gptoss.rollout.weights.sync import weight_pusher_for

        if self._weight_sync is None:
            self._weight_sync = weight_pusher_for(self)
        return self._weight_sync

    def push_weights(self, model) -> None:
        """Make the server sample from ``model``'s current parameters (every tensor; see
        ``trl_gptoss.rollout.weights.sync``). Collective under ``torch.distributed``: every rank calls it, rank 0
        sends."""
        from trl_gptoss.rollout.weights import push_model

        push_model(lambda: [self.pusher()], model)

    def close(self) -> None:
        self._http.close()
        if self._weight_sync is not None:
            self._weight_sync.close()


def _server_error(url: str, response) -> str | None:
    """``None`` for a success; the retryable error of a 5xx answer; raises for a 3xx answer (a redirect is never
    followed: pushes and scores must reach the server they were given) and a 4xx answer (a request the server
    refuses is not repeated): ``ValueError`` when it is too long for the context, else ``VLLMServerError``, both
    naming the URL, the status and the server's message."""
    status, text = response.status, response.text
    if status < 300:
        return None
    if status < 400:
        where = response.headers.get("location", "nowhere")[:200]
        raise VLLMServerError(
            f"vLLM server at {url} answered HTTP {status}, a redirect to {where!r}; redirects are refused: give the "
            "server's own URL"
        )
    if status >= 500:
        return f"HTTP {status}: {text[:500]}"
    detail = text[:1000]
    if status == 400 and "max" in detail and ("context" in detail or "length" in detail):
        raise ValueError(f"vLLM server at {url} rejected the request as too long: {detail}")
    if status in (401, 403):
        raise VLLMServerError(
            f"vLLM server at {url} answered HTTP {status}: {detail}; this route needs the server's secret: set "
            "$TRL_GPTOSS_SERVER_SECRET or $TRL_GPTOSS_SERVER_SECRET_FILE (check-sync: --secret-file) to the one "
            "the server was started with"
        )
    raise VLLMServerError(f"vLLM server at {url} answered HTTP {status}: {detail}")
