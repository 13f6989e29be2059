"""Push a trainer model's weights into running vLLM servers, every parameter, one decoder layer at a time.

``push_model(make_pushers, model)`` is the one driver: every rank calls it; the pushing rank builds one pusher
per server and feeds each the layers ``push_layers`` yields; the other ranks only take part in the gathers.
A failure on the pushing rank still walks the remaining gathers (so no rank hangs in a collective), then every
rank raises. The server side is the worker extension ``vllm_worker/gptoss_vllm_worker.py``:

- CPU (``HTTPWeightPusher``): generation paused (``/pause?mode=wait``) until the push ends; ONE reload
  session for the whole model (``gptoss_start_reload``, one ``gptoss_load_weights`` per layer with that
  layer's reload-route tensors, ``gptoss_finish_reload``), then one ``gptoss_load_weights`` per layer for the
  sinks and experts that reload drops (written directly). Each group is one safetensors file in shared memory
  (``/dev/shm``; base64 in the request body when the server is not on this host), sent over
  ``/collective_rpc``; every worker's answer lists the names it applied.
- GPU (``NCCLWeightPusher``): generation paused (``/pause?mode=wait``); ONE reload session for the whole
  model (``/start_weight_update``, one ``/update_weights`` + packed NCCL broadcast per layer,
  ``/finish_weight_update``), then one direct pass for the sinks and experts that reload drops
  (``gptoss_receive_direct_nccl``), then ``/resume``. Calls coupled to a broadcast are never retried (a
  retry would wait for a broadcast that already happened); a failed one tears the transfer group down.

Every push ends with ``/reset_prefix_cache`` (checked: it answers ``success: false`` while requests hold
blocks): cached KV blocks were computed with the old weights. Names and shapes are checked against each
served checkpoint before anything is sent.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import time
from collections.abc import Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from safetensors.torch import save, save_file

from trl_gptoss.rollout.push import PushStats, push_layers, pushed_layout

# the worker-side module imports only torch/safetensors at import time: the one rule for what reload drops
from trl_gptoss.rollout.vllm_worker.gptoss_vllm_worker import loads_directly
from trl_gptoss.rollout.weight_sync import check_layout

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}
PASSES = {"all": None, "reload": lambda n: not loads_directly(n), "direct": loads_directly}


def collective_rpc(engine, method: str, *args: str, timeout: float = 600.0, retries: int | None = None) -> list:
    """Call an extension method on every vLLM worker; returns one result per worker."""
    payload = {"method": method, "args": list(args)}
    return engine.request("POST", "/collective_rpc", payload, timeout=timeout, retries=retries)["results"]


def reset_prefix_cache(engine) -> None:
    """Drop KV blocks computed with the old weights; an error when the server refuses (blocks still held)."""
    answer = engine.request("POST", "/reset_prefix_cache")
    if isinstance(answer, dict) and answer.get("success") is False:
        raise RuntimeError(
            f"vLLM server at {engine.base_url} refused /reset_prefix_cache (requests still hold KV blocks): its "
            "cache would mix old-weight blocks into new samples; push only while no request is in flight"
        )


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
        self._server_seconds["finish_reload"] += results[0]["seconds"]

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
        for result in results:
            applied = set(result["reloaded"]) | set(result["direct"])
            if applied != set(tensors):
                raise RuntimeError(
                    f"vLLM worker at {self.engine.base_url} applied {sorted(applied)} but was sent {sorted(tensors)}"
                )
        return results[0]["seconds"]

    def close(self) -> None:
        pass


def _plan(make_pushers, to_rank: int) -> tuple[list, dict]:
    """On ``to_rank``: the pushers and the plan every rank needs to gather the same tensors in the same dtype
    (``{"passes": [...], "dtype": "bfloat16"}`` or ``{"error": ...}``), shared with the other ranks."""
    distributed = dist.is_available() and dist.is_initialized()
    pushers, plan = [], None
    if not distributed or dist.get_rank() == to_rank:
        try:
            pushers = list(make_pushers())
            kinds = {tuple(p.passes) for p in pushers}
            if len(kinds) != 1:
                raise ValueError(
                    "weight push: the servers' pushers take different passes; push to one kind of server at a time"
                )
            plan = {"passes": list(kinds.pop()), "dtype": str(pushers[0].dtype).removeprefix("torch.")}
        except Exception as exc:
            plan = {"error": f"{type(exc).__name__}: {exc}"}
            if not distributed:
                raise
            _share(plan, to_rank)
            raise
    return pushers, (_share(plan, to_rank) if distributed else plan)


def _share(obj, src: int):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def push_model(make_pushers: Callable[[], list], model, *, to_rank: int = 0, stats: PushStats | None = None):
    """Collective weight push: every rank calls it with the same model. ``make_pushers()`` runs on ``to_rank``
    only (one pusher per server); each pusher gets every layer of every pass. Returns the pushers (empty on
    the other ranks). Raises on every rank when the pushing rank failed, after all gathers completed."""
    pushers, plan = _plan(make_pushers, to_rank)
    if "error" in plan:
        raise RuntimeError(f"weight push: rank {to_rank} could not reach the rollout servers: {plan['error']}")
    layout, dtype = pushed_layout(model), getattr(torch, plan["dtype"])
    error = _each(pushers, lambda p: p.begin(layout))
    if _failed_anywhere(error, to_rank):  # refused before anything was sent (names, shapes, a dead server)
        _raise(pushers, error, to_rank)
    for pass_name in plan["passes"]:
        for layer in push_layers(model, dtype=dtype, to_rank=to_rank, select=PASSES[pass_name], stats=stats):
            if error is None:
                error = _each(pushers, lambda p, layer=layer, name=pass_name: p.send(name, layer))
            del layer  # before the next layer is gathered
        if error is None:
            error = _each(pushers, lambda p, name=pass_name: p.end_pass(name))
    if error is None:
        error = _each(pushers, lambda p: p.finish())
    if _failed_anywhere(error, to_rank):  # every gather is done: no rank is left inside a collective
        _raise(pushers, error, to_rank)
    return pushers


def _failed_anywhere(error, to_rank: int) -> bool:
    distributed = dist.is_available() and dist.is_initialized()
    return _share(error is not None, to_rank) if distributed else error is not None


def _raise(pushers, error, to_rank: int):
    for pusher in pushers:
        pusher.abort()
    if error is not None:
        raise error
    raise RuntimeError(f"weight push failed on rank {to_rank}; its log has the error")


def _each(pushers, call) -> BaseException | None:
    for pusher in pushers:
        try:
            call(pusher)
        except Exception as exc:  # noqa: BLE001 (re-raised by push_model once every rank is done)
            return exc
    return None


def weight_pusher_for(engine):
    """NCCL when the server has an NCCL weight-transfer engine and this process a GPU, else the HTTP push.

    One extension call tells both the served layout and the server's transfer backend (``/server_info`` would
    too, but it collects the whole system environment first: ~10 s).
    """
    (info,) = collective_rpc(engine, "gptoss_checkpoint_layout")[:1]
    if info.get("weight_transfer_backend") == "nccl" and torch.cuda.is_available():
        from trl_gptoss.rollout.weight_sync_nccl import NCCLWeightPusher

        return NCCLWeightPusher(engine, info)
    return HTTPWeightPusher(engine, info)


def __getattr__(name):
    if name == "NCCLWeightPusher":  # lives in weight_sync_nccl; importable from here as before
        from trl_gptoss.rollout.weight_sync_nccl import NCCLWeightPusher

        return NCCLWeightPusher
    raise AttributeError(name)
