"""ASGI middleware of the vLLM API server: the routes that change or pause the server need the run's secret.

Loaded by vLLM (``--middleware gptoss_vllm_auth.SecretMiddleware``) in the server's own interpreter; imports only
the standard library. The secret comes from ``$TRL_GPTOSS_SERVER_SECRET`` (set by the launcher in the server's
environment, never on its command line); without one the server does not start.

Default deny: only the serving and read-only routes in ``OPEN_ROUTES`` answer without ``Authorization: Bearer
<secret>``. Everything else answers 401: ``/collective_rpc`` (and so every method of our worker extension),
``/pause``, ``/resume``, ``/reset_prefix_cache`` and the other cache resets, the weight-transfer routes,
``/sleep``, LoRA loading, ``/server_info`` (its environment dump would show the secret), and any route a later
vLLM adds. vLLM's own ``--api-key`` guards only ``/v1/...``; the two check the same header, so a server started
with ``VLLM_API_KEY`` set to the same secret closes sampling too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

SECRET_ENV = "TRL_GPTOSS_SERVER_SECRET"  # trl_gptoss.rollout.server_secret.SECRET_ENV (this file cannot import it)
OPEN_ROUTES = {
    "GET": {"/health", "/ping", "/version", "/load", "/metrics", "/is_paused", "/is_sleeping", "/get_world_size"}
    | {"/v1/models"},
    "POST": {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"},
}
_REFUSAL = json.dumps(
    {"error": "this route needs the run's server secret (Authorization: Bearer <secret>); see docs/rollouts.md"}
).encode()


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class SecretMiddleware:
    """Pure ASGI middleware: a request to a route outside ``OPEN_ROUTES`` passes only with the secret."""

    def __init__(self, app, secret: str | None = None):
        secret = secret if secret is not None else os.environ.get(SECRET_ENV, "")
        if not secret:
            raise RuntimeError(f"gptoss_vllm_auth.SecretMiddleware: ${SECRET_ENV} is empty; refusing to start open")
        self.app = app
        self._expected = _digest(f"Bearer {secret}".encode())

    def allowed(self, scope) -> bool:
        method = scope.get("method", "")
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path.rstrip("/") in OPEN_ROUTES.get("GET" if method == "HEAD" else method, ()):
            return True
        given = [value for name, value in scope.get("headers", ()) if name.lower() == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(_digest(given[0]), self._expected)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(_REFUSAL)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": _REFUSAL})
