"""CPU weight push into a vLLM server over ``/collective_rpc`` (the worker extension ``gptoss_vllm_worker``).

One push (driven by ``sync.push_model``): generation paused (``/pause?mode=wait``) until the push ends; ONE
reload session for the whole model (``gptoss_start_reload``, one ``gptoss_load_weights`` per layer with that
layer's reload-route tensors, ``gptoss_finish_reload``), then one ``gptoss_load_weights`` per layer for the
sinks and experts that reload drops (written directly), ``/reset_prefix_cache`` (checked), ``/resume``. Each
group is one safetensors file in shared memory (``/dev/shm``; base64 in the request body when the server is not
on this host), sent over ``/collective_rpc``; every worker's answer lists the names it applied.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import time
from urllib.parse import urlparse

import torch
from safetensors.torch import save, save_file

from trl_gptoss.rollout.weights.names import check_layout
from trl_gptoss.rollout.weights.server_calls import collective_rpc, reset_prefix_cache

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


class HTTPWeightPusher:
    """CPU push over ``/collective_rpc`` (see the module docstring). ``last_push`` holds bytes and seconds."""

    passes = ("reload", "direct")

    def __init__(self, engine, info: dict):
        self.engine = engine
        self.layout, self.dtype = info["layout"], getattr(torch, info["dtype"])
        local = urlparse(engine.base_url).hostname in _LOCAL_HOSTS
        self.shared_dir = ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) if local else None
        self.last_push: dict = {}
        self._paused = self._reloading = False

    def begin(self, layout: dict[str, list[int]]) -> None:
        check_layout(layout, self.layout, self.engine.base_url)
        self._started, self._sent = time.perf_counter(), 0
        self._server_seconds = {"read": 0.0, "reload": 0.0, "direct": 0.0, "finish_reload": 0.0}
        self._calls = {"start_reload": 0, "load": 0, "finish_reload": 0}
        self.engine.request("POST", "/pause?mode=wait")  # requests in flight finish on the old weights first
        self._paused = True

    def send(self, pass_name: str, group: list[tuple[str, torch.Tensor]]) -> None:
        if pass_name == "reload" and not self._reloading:  # opened on the first group: no empty sessions
            collective_rpc(self.engine, "gptoss_start_reload")
            self._reloading = True
            self._calls["start_reload"] += 1
        tensors = {n: t.detach().to("cpu", self.dtype).contiguous() for n, t in group}
        self._sent += sum(t.numel() * t.element_size() for t in tensors.values())
        for key, value in self._apply(tensors).items():
            if key in self._server_seconds and isinstance(value, (int, float)):
                self._server_seconds[key] += value

    def end_pass(self, pass_name: str) -> None:
        if pass_name == "reload" and self._reloading:
            self._finish_reload()

    def finish(self) -> None:
        reset_prefix_cache(self.engine)
        self.abort()  # resume generation
        seconds = time.perf_counter() - self._started
        self.last_push = {
            "bytes": self._sent,
            "seconds": seconds,
            "gb_per_s": self._sent / 1e9 / seconds,
            "server_seconds": self._server_seconds,
            "calls": self._calls,
        }

    def abort(self) -> None:
        """Leave the server serving: close an open reload session (layers nothing reached keep their old
        weights), then resume generation."""
        try:
            if self._reloading:
                self._finish_reload()
        finally:
            if self._paused:
                self._paused = False
                self.engine.request("POST", "/resume")

    def _finish_reload(self) -> None:
        self._reloading = False
        results = collective_rpc(self.engine, "gptoss_finish_reload")
        self._calls["finish_reload"] += 1
        seconds = results[0].get("seconds") if isinstance(results[0], dict) else None
        self._server_seconds["finish_reload"] += seconds if isinstance(seconds, (int, float)) else 0.0

    def _apply(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """Send one group; returns the first worker's time split (read / reload / direct load + repack)."""
        self._calls["load"] += 1
        if self.shared_dir is None:
            source = {"b64": base64.b64encode(save(tensors)).decode()}
            results = collective_rpc(self.engine, "gptoss_load_weights", json.dumps(source))
        else:
            fd, path = tempfile.mkstemp(prefix="gptoss-push-", suffix=".safetensors", dir=self.shared_dir)
            os.close(fd)
            try:
                save_file(tensors, path)
                results = collective_rpc(self.engine, "gptoss_load_weights", json.dumps({"path": path}))
            finally:
                os.unlink(path)
        for index, result in enumerate(results):
            if not isinstance(result, dict) or not all(isinstance(result.get(k), list) for k in ("reloaded", "direct")):
                raise RuntimeError(
                    f"vLLM server at {self.engine.base_url}/collective_rpc: field results[{index}] of "
                    f"gptoss_load_weights is not {{reloaded: [...], direct: [...], ...}}: {str(result)[:200]}"
                )
            applied = set(map(str, result["reloaded"])) | set(map(str, result["direct"]))
            if applied != set(tensors):
                raise RuntimeError(
                    f"vLLM worker at {self.engine.base_url} applied {sorted(applied)} but was sent {sorted(tensors)}"
                )
        seconds = results[0].get("seconds")
        return seconds if isinstance(seconds, dict) else {}

    def close(self) -> None:
        pass
