"""``push_model``: a trainer model's weights into running vLLM servers, every parameter, one layer at a time.

``push_model(make_pushers, model)`` is the one driver: every rank calls it; the pushing rank builds one pusher
per server and feeds each the layers ``push_layers`` yields; the other ranks only take part in the gathers.
A failure on the pushing rank still walks the remaining gathers (so no rank hangs in a collective), then every
rank raises. The server side is the worker extension ``vllm_worker/gptoss_vllm_worker.py``.

``weight_pusher_for(engine)`` picks a server's pusher: the process-group push (``group_push``: a process group
the trainer and the server's workers form, gloo on CPUs and NCCL between GPUs) by default, or the shared-memory
file push (``http_push``) when ``transport="file"`` or ``$TRL_GPTOSS_WEIGHT_TRANSPORT=file``. Both push in two
passes (``PASSES``; ``server_pusher``): ``reload``, the tensors vLLM's layerwise reload applies, in ONE reload
session for the whole model, then ``direct``, the sinks and experts that reload drops, written directly. Every
push ends with ``/reset_prefix_cache`` (checked: it answers ``success: false`` while requests hold blocks):
cached KV blocks were computed with the old weights. Names and shapes are checked against each served
checkpoint before anything is sent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

# the worker-side module imports only torch/safetensors at import time: the one rule for what reload drops
from trl_gptoss.named_collectives import broadcast_object
from trl_gptoss.rollout.vllm_worker.gptoss_vllm_worker import loads_directly
from trl_gptoss.rollout.weights.group_push import GroupWeightPusher
from trl_gptoss.rollout.weights.http_push import HTTPWeightPusher
from trl_gptoss.rollout.weights.push import PushStats, push_layers, pushed_layout
from trl_gptoss.rollout.weights.server_calls import collective_rpc

logger = logging.getLogger(__name__)

TRANSPORT_ENV = "TRL_GPTOSS_WEIGHT_TRANSPORT"
# How long the other ranks wait for the pushing rank at the push's own collectives: it may be joining servers
# (each bounded by the pusher's timeout) or sending the last layers first.
COLLECTIVE_TIMEOUT_S = 1800.0
TRANSPORTS = ("process_group", "file")
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
            _share(plan, to_rank, "the push plan")
            raise
    return pushers, (_share(plan, to_rank, "the push plan") if distributed else plan)


def _share(obj, src: int, what: str):
    """``src``'s ``obj`` on every rank, with a deadline: a rank that never joins (it called another collective)
    ends every rank's wait with an error naming ``what`` instead of a silent hang."""
    return broadcast_object(obj, src=src, name=f"weight push: {what}", timeout_s=COLLECTIVE_TIMEOUT_S)


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
    return _share(error is not None, to_rank, "did the pushing rank fail") if distributed else error is not None


def _raise(pushers, error, to_rank: int):
    for pusher in pushers:
        try:
            pusher.abort()
        except Exception as exc:  # noqa: BLE001 (a server that died mid-push cannot resume; the push's error is raised)
            logger.warning("weight push: %s could not be resumed after the failure: %s", pusher.engine.base_url, exc)
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


def weight_pusher_for(engine, transport: str | None = None, **options):
    """The pusher of one server: ``transport`` ``"process_group"`` (default; ``options`` go to
    ``GroupWeightPusher``, which joins the server's workers now) or ``"file"``; unset: ``$TRL_GPTOSS_WEIGHT_TRANSPORT``.

    One extension call tells the served layout, dtype and every worker's device and rank (``/server_info`` would
    too, but it collects the whole system environment first: ~10 s).
    """
    transport = transport or os.environ.get(TRANSPORT_ENV) or "process_group"
    if transport not in TRANSPORTS:
        raise ValueError(f"weight transport must be one of {TRANSPORTS} (${TRANSPORT_ENV}), got {transport!r}")
    infos = collective_rpc(engine, "gptoss_checkpoint_layout")
    if transport == "file":
        return HTTPWeightPusher(engine, infos[0])
    pusher = GroupWeightPusher(engine, infos, **options)
    pusher.connect()
    return pusher
