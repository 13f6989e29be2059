"""The server calls both pushers make: an extension method on every vLLM worker, and the prefix-cache reset."""

from __future__ import annotations

from trl_gptoss.rollout.server_answers import MalformedAnswer, VLLMServerError, rpc_results


def collective_rpc(engine, method: str, *args: str, timeout: float = 600.0, retries: int | None = None) -> list:
    """Call an extension method on every vLLM worker; returns one result per worker (a ``VLLMServerError`` naming
    the URL and the field when the answer has none)."""
    payload = {"method": method, "args": list(args)}
    answer = engine.request("POST", "/collective_rpc", payload, timeout=timeout, retries=retries)
    try:
        return rpc_results(answer)
    except MalformedAnswer as exc:
        raise VLLMServerError(f"vLLM server at {engine.base_url}/collective_rpc ({method}): {exc}") from None


def reset_prefix_cache(engine) -> None:
    """Drop KV blocks computed with the old weights; an error when the server refuses (blocks still held)."""
    answer = engine.request("POST", "/reset_prefix_cache")
    if isinstance(answer, dict) and answer.get("success") is False:
        raise RuntimeError(
            f"vLLM server at {engine.base_url} refused /reset_prefix_cache (requests still hold KV blocks): its "
            "cache would mix old-weight blocks into new samples; push only while no request is in flight"
        )
