"""The engine kinds a trainer samples from: one table, one row per kind (``rollout_backend`` names a row).

A kind is a ``RolloutEngine`` module in ``trl_gptoss/rollout/`` plus a row here: how to build the engine for a
policy, whether it is fed by a rollout server (``rollout_server_url``; started from the policy when unset),
whether it may sample in the background while the policy trains (``max_staleness: 1`` needs a separate copy of
the weights) and whether it reports its routers' experts (``routing_replay: rollout``). The config validates
``rollout_backend`` and those properties against this table, the ``Sampler`` builds from it; nothing else names
a kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltEngine:
    """An engine and what to release with it (a server it started, its model copy), or ``None``."""

    engine: object
    release: Callable[[], None] | None = None


@dataclass(frozen=True)
class EngineKind:
    """``build(args, model, tokenizer) -> BuiltEngine``: collective under ``torch.distributed`` (every rank calls
    it with its own, possibly sharded, policy). ``needs_server``: samples from ``rollout_server_url``.
    ``may_overlap``: may sample the next batch while this step trains (it holds its own copy of the weights).
    ``returns_routes``: its engine reports the experts its routers chose (``enable_routes()``; ``routing_replay:
    rollout``)."""

    build: Callable[..., BuiltEngine]
    needs_server: bool
    may_overlap: bool
    returns_routes: bool = False


def build_in_process(args, model, tokenizer) -> BuiltEngine:
    """Generation with the policy itself (CPU demos, tests): no weights to copy, so nothing to overlap."""
    from trl_gptoss.rollout.transformers_engine import TransformersEngine

    return BuiltEngine(TransformersEngine(model, tokenizer))


def build_vllm_server(args, model, tokenizer) -> BuiltEngine:
    """One or more ``vllm serve`` processes (``rollout_server_url``, their secret from the environment), or one
    started from the policy (with this run's own secret). Token ids the servers send must be in the policy's
    vocabulary."""
    from trl_gptoss.rollout.multi_server import MultiServerEngine
    from trl_gptoss.rollout.vllm_engine import VLLMServerEngine
    from trl_gptoss.rollout.weights.names import unwrap
    from trl_gptoss.trainer.sampling.servers import check_server, refuse_zero3, start_server

    refuse_zero3(args, model)
    urls, secret, release = args.rollout_server_url, None, None
    if urls is None:
        url, secret, release = start_server(args, model, tokenizer)
        urls = [url]
    check_server(urls)
    options = {"secret": secret, "vocab_size": getattr(unwrap(model, peft=True).config, "vocab_size", None)}
    engine = VLLMServerEngine(urls[0], **options) if len(urls) == 1 else MultiServerEngine(urls, **options)
    try:
        join_weight_groups(engine)
    except BaseException:
        engine.close()
        if release is not None:
            release()
        raise
    return BuiltEngine(engine, release)


def join_weight_groups(engine) -> None:
    """The pushing rank (rank 0) builds every server's pusher now, which joins its weight group: a server that
    cannot reach the trainer fails the run here, before its first step, not at its first push. Collective: every
    rank learns rank 0's outcome and raises with it."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    error = None
    if not distributed or dist.get_rank() == 0:
        try:
            for server in getattr(engine, "engines", [engine]):
                server.pusher()
        except Exception as exc:  # noqa: BLE001 (shared with every rank, then raised)
            if not distributed:
                raise
            error = f"{type(exc).__name__}: {exc}"
    if distributed:
        from trl_gptoss.named_collectives import broadcast_object
        from trl_gptoss.rollout.weights.sync import COLLECTIVE_TIMEOUT_S

        error = broadcast_object(
            error, src=0, name="joining the servers' weight groups", timeout_s=COLLECTIVE_TIMEOUT_S
        )
        if error is not None:
            raise RuntimeError(f"rank 0 could not join the rollout servers' weight groups: {error}")


ENGINE_KINDS: dict[str, EngineKind] = {
    "vllm_server": EngineKind(build=build_vllm_server, needs_server=True, may_overlap=True, returns_routes=True),
    "transformers": EngineKind(build=build_in_process, needs_server=False, may_overlap=False),
}
