"""A rollout server for the ``vllm_server`` engine kind: checked when given, started from the policy when not."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def server_url_problems(urls: list[str], timeout: float = 10.0) -> list[str]:
    """One message per ``rollout_server_url`` entry that does not answer ``GET /health`` with 200 (``urls``: as
    ``GptOssGRPOConfig`` normalised them): the job reports them before any model loads, the trainer at
    construction."""
    from trl_gptoss.rollout.server import unhealthy

    return [
        f"rollout_server_url entry {url!r} does not answer GET /health ({status}); start the server "
        "(`trl-gptoss vllm-serve ...`), drop it from the list, or set rollout_server_url: null to start one"
        for url, status in unhealthy(urls, timeout)
    ]


def check_server(urls: list[str], timeout: float = 10.0) -> None:
    """Raise at construction, naming every rollout server that does not answer ``GET /health`` with 200."""
    problems = server_url_problems(urls, timeout)
    if problems:
        raise ValueError("; ".join(problems))


def refuse_zero3(args, model) -> None:
    """The weight push gathers FSDP2 shards, not DeepSpeed ZeRO-3 partitions: refuse ZeRO-3 at construction
    (a push would send empty shards) and say what to use instead."""
    from trl_gptoss.rollout.weights.push import ZERO3_MESSAGE, pushed_layout

    ds_config = getattr(args, "hf_deepspeed_config", None)
    zero3 = bool(ds_config is not None and getattr(ds_config, "is_zero3", lambda: False)())
    zero3 = zero3 or os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    if zero3:
        raise ValueError(f"rollout_backend={args.rollout_backend!r} with DeepSpeed ZeRO-3: {ZERO3_MESSAGE}")
    pushed_layout(model)  # raises, naming the parameter, when parameters are already ZeRO-3 partitions


def start_server(args, model, tokenizer):
    """Save a merged COPY of the model (``push_layers``: adapters merged into gathered copies, the trained model
    untouched, one layer in memory at a time) and serve it with ``vllm serve``; its weights are replaced by a push
    before the first rollout anyway. The server binds loopback and gets a fresh secret (``server_secret``) for
    its weight, pause and cache routes: only this run can change what it serves. Collective under
    ``torch.distributed``: every rank calls it, rank 0 writes the checkpoint and starts the one server, every rank
    gets its URL and secret. Returns ``(url, secret, release)``: ``release`` stops the server and removes the copy
    (also registered at exit), ``None`` on the other ranks."""
    import torch.distributed as dist

    from trl_gptoss.rollout.server import VLLMServer
    from trl_gptoss.rollout.server_secret import new_secret
    from trl_gptoss.rollout.weights.merged_checkpoint import save_merged_checkpoint

    distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_rank() != 0:
        save_merged_checkpoint(model, None)
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            raise RuntimeError("rank 0 could not start the vLLM rollout server; its log has the error")
        url, secret = box[0]
        return url, secret, None
    extra_args = ["--enforce-eager"] if args.routing_replay == "rollout" else []  # route capture: no CUDA graphs
    tmp = tempfile.TemporaryDirectory(prefix="trl-gptoss-rollout-")
    path = Path(tmp.name)
    try:
        save_merged_checkpoint(model, path)
        tokenizer.save_pretrained(path)
        server = VLLMServer(
            path,
            max_model_len=args.rollout_max_model_len,
            startup_timeout=args.rollout_server_timeout,
            remove_on_exit=[path],  # the model copy goes with the server, even if this process is killed
            secret=new_secret(),
            extra_args=extra_args,
        )
    except BaseException:
        tmp.cleanup()  # no server owns the copy yet
        if distributed:
            dist.broadcast_object_list([None], src=0)
        raise
    release = _releaser(server, tmp)
    started = None
    try:
        server.start()
        started = (server.base_url, server.secret)
    finally:
        atexit.register(release)  # a server this process started never outlives it
        if distributed:  # the other ranks wait for the URL and secret (None: the start failed)
            dist.broadcast_object_list([started], src=0)
    logger.info("started a vLLM rollout server at %s", server.base_url)
    return server.base_url, server.secret, release


def _releaser(server, tmp: tempfile.TemporaryDirectory):
    def release() -> None:  # idempotent: called by close() and again at exit
        server.stop()
        with contextlib.suppress(OSError):
            tmp.cleanup()

    return release
