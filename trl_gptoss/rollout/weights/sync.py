"""``push_model``: a trainer model's weights into running vLLM servers, every parameter, one layer at a time.

``push_model(make_pushers, model)`` is the one driver: every rank calls it; the pushing rank builds one pusher
per server and feeds each the layers ``push_layers`` yields; the other ranks only take part in the gathers.
A failure on the pushing rank still walks the remaining gathers (so no rank hangs in a collective), then every
rank raises. The server side is the worker extension ``vllm_worker/gptoss_vllm_worker.py``.

``weight_pusher_for(engine)`` picks a server's pusher: ``HTTPWeightPusher`` on the CPU (``http_push``),
``NCCLWeightPusher`` on a GPU (``nccl_push``). Both push in two passes (``PASSES``): ``reload``, the tensors
vLLM's layerwise reload applies, in ONE reload session for the whole model, then ``direct``, the sinks and
experts that reload drops, written directly. Every push ends with ``/reset_prefix_cache`` (checked: it answers
``success: false`` while requests hold blocks): cached KV blocks were computed with the old weights. Names and
shapes are checked against each served checkpoint before anything is sent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# the worker-side module imports only torch/safetensors at import time: the one rule for what reload drops
from trl_gptoss.rollout.vllm_worker.gptoss_vllm_worker import loads_directly
from trl_gptoss.rollout.weights.http_push import HTTPWeightPusher
from trl_gptoss.rollout.weights.nccl_push import NCCLWeightPusher
from trl_gptoss.rollout.weights.push import PushStats, push_layers, pushed_layout
from trl_gptoss.rollout.weights.server_calls import collective_rpc

PASSES = {"all": None, "reload": lambda n: not loads_directly(n), "direct": loads_directly}


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
        return NCCLWeightPusher(engine, info)
    return HTTPWeightPusher(engine, info)
