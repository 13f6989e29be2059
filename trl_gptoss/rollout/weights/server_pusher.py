"""What every push into a vLLM server does, whatever carries the tensors (``ServerWeightPusher``).

One push (driven by ``sync.push_model``): generation paused (``/pause?mode=wait``: requests in flight finish on
the old weights first) until the push ends; ONE reload session for the whole model (``gptoss_start_reload``, one
group per layer with that layer's reload-route tensors, ``gptoss_finish_reload``), then one group per layer for
the sinks and experts that reload drops (written directly), ``/reset_prefix_cache`` (checked), ``/resume``. Names
and shapes are checked against the served checkpoint before anything is sent; every worker's answer must list
exactly the names it was sent.

A transport subclass implements ``_deliver(tensors)``: start carrying one group to every worker of the server and
return a function that waits for the workers' answers. The next server call waits for them first, so a transport
may let the trainer gather the next layer while the server receives or applies this one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from trl_gptoss.rollout.weights.names import check_layout
from trl_gptoss.rollout.weights.server_calls import collective_rpc, reset_prefix_cache


class ServerWeightPusher:
    """The push protocol for one server (see the module docstring). ``last_push`` holds bytes and seconds."""

    passes = ("reload", "direct")
    transport = ""

    def __init__(self, engine, info: dict):
        self.engine = engine
        self.layout, self.dtype = info["layout"], getattr(torch, info["dtype"])
        self.last_push: dict = {}
        self._paused = self._reloading = False
        self._pending: Callable[[], list] | None = None
        self._pending_names: list[str] = []

    def _deliver(self, tensors: list[tuple[str, torch.Tensor]]) -> Callable[[], list]:
        raise NotImplementedError

    def begin(self, layout: dict[str, list[int]]) -> None:
        check_layout(layout, self.layout, self.engine.base_url)
        self._started, self._sent = time.perf_counter(), 0
        self._server_seconds = {"read": 0.0, "reload": 0.0, "direct": 0.0, "finish_reload": 0.0}
        self._calls = {"start_reload": 0, "load": 0, "finish_reload": 0}
        self.engine.request("POST", "/pause?mode=wait")
        self._paused = True

    def send(self, pass_name: str, group: list[tuple[str, torch.Tensor]]) -> None:
        self._collect()
        if pass_name == "reload" and not self._reloading:  # opened on the first group: no empty sessions
            collective_rpc(self.engine, "gptoss_start_reload")
            self._reloading = True
            self._calls["start_reload"] += 1
        tensors = [(n, t.detach().to(self._staging_device(), self.dtype).contiguous()) for n, t in group]
        self._sent += sum(t.numel() * t.element_size() for _, t in tensors)
        self._calls["load"] += 1
        self._pending_names = [n for n, _ in tensors]
        self._pending = self._deliver(tensors)

    def _staging_device(self) -> torch.device:
        return torch.device("cpu")

    def end_pass(self, pass_name: str) -> None:
        self._collect()
        if pass_name == "reload" and self._reloading:
            self._finish_reload()

    def finish(self) -> None:
        self._collect()
        reset_prefix_cache(self.engine)
        self.abort()  # resume generation
        seconds = time.perf_counter() - self._started
        self.last_push = {
            "transport": self.transport,
            "bytes": self._sent,
            "seconds": seconds,
            "gb_per_s": self._sent / 1e9 / seconds,
            "server_seconds": self._server_seconds,
            "calls": self._calls,
        }

    def abort(self) -> None:
        """Leave the server serving: wait out a group in flight (its error is the push's, already raised or
        about to be), close an open reload session (layers nothing reached keep their old weights), resume."""
        try:
            if self._pending is not None:
                self._pending = None
                self._on_abort()
            if self._reloading:
                self._finish_reload()
        finally:
            if self._paused:
                self._paused = False
                self.engine.request("POST", "/resume")

    def _on_abort(self) -> None:
        """A group was in flight when the push failed: the transport drops what it holds."""

    def _collect(self) -> None:
        """Wait for the group in flight, check every worker applied exactly what it was sent."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        self._check_applied(pending(), self._pending_names)

    def _check_applied(self, results: list, names: list[str]) -> None:
        """Every worker's answer to one group lists exactly ``names`` as applied; adds its time split."""
        for index, result in enumerate(results):
            if not isinstance(result, dict) or not all(isinstance(result.get(k), list) for k in ("reloaded", "direct")):
                raise RuntimeError(
                    f"vLLM server at {self.engine.base_url}/collective_rpc: field results[{index}] of the weight "
                    f"load is not {{reloaded: [...], direct: [...], ...}}: {str(result)[:200]}"
                )
            applied = set(map(str, result["reloaded"])) | set(map(str, result["direct"]))
            if applied != set(names):
                raise RuntimeError(
                    f"vLLM worker at {self.engine.base_url} applied {sorted(applied)} but was sent {sorted(names)}"
                )
        seconds = results[0].get("seconds") if results and isinstance(results[0], dict) else None
        for key, value in (seconds if isinstance(seconds, dict) else {}).items():
            if key in self._server_seconds and isinstance(value, (int, float)):
                self._server_seconds[key] += value

    def _finish_reload(self) -> None:
        self._reloading = False
        results = collective_rpc(self.engine, "gptoss_finish_reload")
        self._calls["finish_reload"] += 1
        seconds = results[0].get("seconds") if isinstance(results[0], dict) else None
        self._server_seconds["finish_reload"] += seconds if isinstance(seconds, (int, float)) else 0.0

    def close(self) -> None:
        pass
