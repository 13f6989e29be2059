"""Rollout engine that samples from a vLLM server over HTTP: token-id prompts in, token ids + log-probs out.

Every process (each rank of a training job) talks to the server itself; nothing is gathered to rank 0 and no
process assumes anything about the others, so processes that make different numbers of tool calls never
exchange continuations. ``generate`` (what rollouts await) sends its request from the event loop itself over
kept-alive connections (``http_async``), so no thread carries requests out and back; the blocking calls
(``generate_sync``, ``score``, the start-up query, weight pushes) use one ``requests.Session`` per thread. Both
paths give every call a connect and a read timeout and retry it with exponential backoff on connection
errors, timeouts, cut-short answers and 5xx answers. When the server stays unreachable the error names its URL.
"""

from __future__ import annotations

import asyncio
import threading
import time

import requests

from trl_gptoss.rollout.http_async import AsyncHTTPClient, HTTPTransportError
from trl_gptoss.rollout.types import Generation, GenerationRequest


class VLLMServerError(RuntimeError):
    """The vLLM server at ``base_url`` did not answer (after retries) or answered with an error."""


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


def generation_from_choice(choice: dict) -> Generation:
    """Parse one ``choices[i]`` of a completions answer; the two token-id sources must agree."""
    from_logprobs = [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
    token_ids = choice.get("token_ids") or from_logprobs
    if token_ids != from_logprobs:
        raise VLLMServerError(f"vLLM returned inconsistent token ids: {token_ids[:8]} vs {from_logprobs[:8]}")
    finish = choice["finish_reason"]
    if finish not in ("stop", "length"):
        raise VLLMServerError(f"vLLM finished a completion with {finish!r} (expected 'stop' or 'length')")
    return Generation(token_ids, [float(x) for x in choice["logprobs"]["token_logprobs"]], finish)


class VLLMServerEngine:
    """``RolloutEngine`` backed by a running vLLM server (``trl-gptoss vllm-serve`` or ``VLLMServer``).

    ``model``: the served model id (default: the only one ``/v1/models`` lists). ``timeout``: read timeout of
    one HTTP call in seconds; ``connect_timeout`` for opening a connection; ``max_retries`` extra attempts,
    ``backoff * 2**i`` seconds apart. A call therefore fails within about
    ``(max_retries + 1) * (connect_timeout + timeout) + backoff * 2**max_retries`` seconds.
    ``max_concurrency``: ``generate`` requests in flight at once from one event loop (its connections to the
    server); more wait for a free connection.
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
    ):
        if max_retries < 0 or timeout <= 0 or connect_timeout <= 0:
            raise ValueError("max_retries must be >= 0 and the timeouts > 0")
        self.base_url = base_url.rstrip("/")
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.max_retries, self.backoff = max_retries, backoff
        self._local = threading.local()
        self._http = AsyncHTTPClient(self.base_url, connect_timeout=connect_timeout, max_connections=max_concurrency)
        served = self.request("GET", "/v1/models")["data"]
        if model is None and len(served) != 1:
            raise ValueError(f"{self.base_url} serves {[m['id'] for m in served]}; pass model=")
        entry = served[0] if model is None else next((m for m in served if m["id"] == model), None)
        if entry is None:
            raise ValueError(f"{self.base_url} does not serve {model!r}; it serves {[m['id'] for m in served]}")
        self.model = entry["id"]
        self.max_model_len = int(entry["max_model_len"])
        self._weight_sync = None

    # -- HTTP -------------------------------------------------------------------------------------------
    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def request(
        self,
        method: str,
        path: str,
        payload: dict | None = None,
        *,
        timeout: float | None = None,
        retries: int | None = None,
    ):
        """One blocking JSON call with retries (``retries``, default ``max_retries``; 0 for calls that must not be
        repeated, e.g. one coupled to an NCCL broadcast); returns the decoded body (``None`` when empty)."""
        url = f"{self.base_url}{path}"
        last_error = None
        attempts = (self.max_retries if retries is None else retries) + 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self._session().request(
                    method, url, json=payload, timeout=(self.connect_timeout, timeout or self.timeout)
                )
            except (requests.ConnectionError, requests.Timeout) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                self._local.__dict__.pop("session", None)  # a broken keep-alive connection is not reused
                continue
            last_error = _server_error(url, response.status_code, response.text)
            if last_error is None:
                return response.json() if response.content else None
        raise VLLMServerError(f"vLLM server at {url} failed after {attempts} attempt(s): {last_error}")

    async def arequest(self, method: str, path: str, payload: dict | None = None, *, timeout: float | None = None):
        """``request`` from the running event loop (``http_async``: no thread), with the same timeouts and
        ``max_retries`` retries."""
        url = f"{self.base_url}{path}"
        last_error = None
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = await self._http.request(method, path, payload, timeout=timeout or self.timeout)
            except HTTPTransportError as exc:
                last_error = str(exc)
                continue
            last_error = _server_error(url, response.status, response.text)
            if last_error is None:
                try:
                    return response.json()
                except ValueError:
                    raise VLLMServerError(
                        f"vLLM server at {url} answered HTTP {response.status} with a body that is not JSON: "
                        f"{response.text[:200]!r}"
                    ) from None
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
        entries = self.request("POST", "/v1/completions", payload)["choices"][0]["prompt_logprobs"][1:]
        return [_logprob_of(token, entry, self.base_url) for token, entry in zip(token_ids[1:], entries)]

    # -- RolloutEngine ----------------------------------------------------------------------------------
    def generate_sync(self, request: GenerationRequest) -> Generation:
        request.check_fits(self.max_model_len)
        answer = self.request("POST", "/v1/completions", completion_payload(self.model, request))
        (choice,) = answer["choices"]
        return generation_from_choice(choice)

    async def generate(self, request: GenerationRequest) -> Generation:
        request.check_fits(self.max_model_len)
        answer = await self.arequest("POST", "/v1/completions", completion_payload(self.model, request))
        (choice,) = answer["choices"]
        return generation_from_choice(choice)

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
        session = self._local.__dict__.pop("session", None)
        if session is not None:
            session.close()
        if self._weight_sync is not None:
            self._weight_sync.close()


def _server_error(url: str, status: int, text: str) -> str | None:
    """``None`` for a success; the retryable error of a 5xx answer; raises for a 4xx answer (a request the
    server refuses is not repeated): ``ValueError`` when it is too long for the context, else
    ``VLLMServerError``, both naming the URL, the status and the server's message."""
    if status < 400:
        return None
    if status >= 500:
        return f"HTTP {status}: {text[:500]}"
    detail = text[:1000]
    if status == 400 and "max" in detail and ("context" in detail or "length" in detail):
        raise ValueError(f"vLLM server at {url} rejected the request as too long: {detail}")
    raise VLLMServerError(f"vLLM server at {url} answered HTTP {status}: {detail}")


def _logprob_of(token: int, entry: dict, url: str) -> float:
    """The log-prob of ``token`` in one ``prompt_logprobs`` entry (keyed ``"N"`` or ``"token_id:N"``)."""
    values = [v["logprob"] for k, v in entry.items() if k in (str(token), f"token_id:{token}")]
    if len(values) != 1:
        raise VLLMServerError(f"vLLM server at {url} returned no prompt log-prob for token {token}: {entry}")
    return float(values[0])
