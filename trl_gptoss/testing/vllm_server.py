"""Test conveniences over the runtime vLLM launcher (``trl_gptoss.rollout.server``).

``VLLMServer`` here adds ``complete`` (``n`` samples of one token-id prompt) and ``post`` for tests that talk to
the server directly; ``vllm_server`` is the context manager fixtures use. Production code uses
``trl_gptoss.rollout.VLLMServer`` / ``VLLMServerEngine`` instead.
"""

from __future__ import annotations

import contextlib

import requests

from trl_gptoss.rollout.server import VLLMServer as _RuntimeVLLMServer
from trl_gptoss.rollout.server import free_port, live_group_members, vllm_python
from trl_gptoss.rollout.types import Generation, GenerationRequest
from trl_gptoss.rollout.vllm_engine import completion_payload, generation_from_choice

Completion = Generation  # one sampled completion: token ids, per-token log-probs, finish reason

__all__ = ["Completion", "VLLMServer", "free_port", "live_group_members", "vllm_python", "vllm_server"]


class VLLMServer(_RuntimeVLLMServer):
    """The runtime launcher plus direct HTTP helpers for tests."""

    def post(self, path: str, payload: dict, timeout: float = 300.0) -> dict:
        response = requests.post(f"{self.base_url}{path}", json=payload, timeout=(5, timeout))
        if response.status_code >= 400:
            raise RuntimeError(f"vLLM {path} answered {response.status_code}: {response.text}")
        return response.json()

    def complete(
        self,
        prompt_ids,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        n: int = 1,
        seed: int | None = 0,
        stop_token_ids=(),
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> list[Generation]:
        """Sample ``n`` completions of one token-id prompt (``temperature=0``: greedy)."""
        request = GenerationRequest(
            list(prompt_ids),
            max_tokens,
            temperature=temperature or 1.0,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop_token_ids=tuple(stop_token_ids),
        )
        payload = {**completion_payload(self.model_dir, request), "n": n, "temperature": temperature}
        choices = sorted(self.post("/v1/completions", payload)["choices"], key=lambda c: c["index"])
        return [generation_from_choice(c) for c in choices]


@contextlib.contextmanager
def vllm_server(model_dir, **kwargs):
    """Start a vLLM server for ``model_dir`` (a saved checkpoint), yield it, always tear it down."""
    with VLLMServer(model_dir, **kwargs) as server:
        yield server
