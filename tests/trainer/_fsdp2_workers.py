"""Code run inside spawned gloo processes by the FSDP2 trainer tests (importable by ``spawn``).

One run function serves three layouts on the same data: FSDP2 (accelerate's preparation on gloo through
``trl_gptoss.testing.fsdp_cpu``), DDP (accelerate's ``MULTI_CPU``) and one process holding both ranks' rows.
"""

from __future__ import annotations

import os

from trl_gptoss.testing.distributed import set_rank_environment

WORLD = 2


def answer_and_position_reward(completions, answer, **kwargs) -> list[float]:
    """The answer reward plus 0.5 on every second row: the two samples of a prompt (adjacent rows on every
    layout) get different rewards even when the taught model samples them identically, so every step has
    non-zero advantages and a real gradient."""
    return [float(c[0]["content"].strip() == a) + 0.5 * (i % 2) for i, (c, a) in enumerate(zip(completions, answer))]


def _args(output_dir: str, layout: str, per_rank_batch: int, **overrides):
    from tests.trainer.helpers import grpo_args
    from trl_gptoss.testing.fsdp_cpu import fsdp_args

    fields = dict(
        per_device_train_batch_size=per_rank_batch * (WORLD if layout == "single" else 1),
        num_generations=2,
        max_steps=3,
        learning_rate=1e-3,
        max_completion_length=64,
        entropy_coef=0.0,
        temperature=1.5,  # the taught model samples varied completions (and 0-2 tool calls) at 1.5
    )
    if layout == "fsdp2":
        fields.update(fsdp_args())
    fields.update(overrides)
    return grpo_args(output_dir, **fields)


def _split_like_ranks(trainer, per_rank_rows: int) -> None:
    """In the single-process layout, sample each half of the batch with the seed stream the rank that would
    own it uses (``process_index`` 0 and 1), so all three layouts train on the same completions."""
    from trl_gptoss.rollout.loop import run_rollouts
    from trl_gptoss.trainer.checks import as_conversation
    from trl_gptoss.trainer.rollouts import rollout_config, rollouts_to_trl
    from trl_gptoss.trainer.sampling import SampledBatch

    def rollout(prompts, trainer_):
        trainer.sampler.push(trainer.state.global_step)
        rollouts = []
        for rank in range(WORLD):
            config = rollout_config(trainer.args, trainer.state.global_step, rank, system=trainer.sampler.system)
            part = prompts[rank * per_rank_rows : (rank + 1) * per_rank_rows]
            rollouts += run_rollouts(
                trainer.sampler.engine,
                [as_conversation(p) for p in part],
                tokenizer=trainer._tokenizer,
                tools=trainer.sampler.tools,
                config=config,
            )
        trainer.sampler.last = SampledBatch(rollouts, trainer.state.global_step, 0.0)
        return rollouts_to_trl(rollouts)

    trainer.rollout_func = rollout


class _DieAfterSave:
    """A ``TrainerCallback`` that ends the process with ``os._exit(137)`` (no cleanup, like a kill) once the
    checkpoint of step ``step`` is written, leaving ``killed-rank{N}`` in ``output_dir`` as evidence."""

    def __new__(cls, step: int, output_dir: str):
        from transformers import TrainerCallback

        class DieAfterSave(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                if state.global_step == step:
                    import torch.distributed as dist

                    dist.barrier()  # both ranks' shards are on disk
                    open(os.path.join(output_dir, f"killed-rank{dist.get_rank()}"), "w").close()
                    os._exit(137)

        return DieAfterSave()


def train_rank(rank: int, world: int, layout: str, state_path: str, output_dir: str, overrides: dict) -> dict:
    """Train the taught model (``state_path``) with real ``add`` tool calls in ``layout`` ("fsdp2", "ddp",
    "single"); per step: loss, grad norm, and the completions/tool calls each rank sampled."""
    if layout != "single":
        set_rank_environment(rank, world)
    import contextlib

    import torch

    from tests.trainer.helpers import SYSTEM, AddTool, load_taught, logged, lora_config, prompt_dataset
    from trl_gptoss.testing import harmony_tokenizer
    from trl_gptoss.testing.fsdp_cpu import fsdp2_on_cpu
    from trl_gptoss.trainer import GptOssGRPOTrainer

    overrides = dict(overrides)
    prompts = overrides.pop("prompts", [0, 2, 1, 2, 0, 1])
    per_rank_batch = overrides.pop("per_rank_batch", 2)
    die_after_save_at = overrides.pop("die_after_save_at", None)
    resume_from = overrides.pop("resume_from", None)
    peft_config = lora_config() if overrides.pop("lora", False) else None
    check_sync_after_push = overrides.pop("check_sync_after_push", False)
    flip_routes = overrides.pop("flip_near_ties", False)  # routers that disagree with the engine on near-ties
    save_final = overrides.pop("save_final", False)  # the job's final save_model, beside the trained tensors
    args = _args(output_dir, layout, per_rank_batch, **overrides)
    with fsdp2_on_cpu() if layout == "fsdp2" else contextlib.nullcontext():
        trainer = GptOssGRPOTrainer(
            load_taught(torch.load(state_path, weights_only=True)),
            answer_and_position_reward,
            args=args,
            train_dataset=prompt_dataset(prompts),
            processing_class=harmony_tokenizer(small=True),
            tools=[AddTool()],
            rollout_system=SYSTEM,
            callbacks=[_DieAfterSave(die_after_save_at, output_dir)] if die_after_save_at else None,
            peft_config=peft_config,
        )
    if layout == "single":
        _split_like_ranks(trainer, per_rank_batch)
    if flip_routes:
        from trl_gptoss.testing.routing import flip_near_ties

        flip_near_ties(trainer.model)
    sampled, route_notes = [], []
    rollout_func = trainer.rollout_func

    def recording(prompts_, trainer_):
        output = rollout_func(prompts_, trainer_)
        sampled.append([[r.completion_ids, r.num_tool_calls] for r in trainer.sampler.last.rollouts])
        route_notes.append([r.route_notes for r in trainer.sampler.last.rollouts])
        return output

    trainer.rollout_func = recording
    sync_reports: list[dict] = []
    if check_sync_after_push:
        from tests.trainer._fsdp2_servers_workers import check_after_every_push

        check_after_every_push(trainer, sync_reports)
    trainer.train(resume_from_checkpoint=resume_from)
    if save_final:
        _save_final(trainer, output_dir)
    return {
        "steps": [h["step"] for h in trainer.state.log_history if "loss" in h],
        "distributed_type": str(trainer.accelerator.distributed_type),
        "fsdp2": bool(trainer.accelerator.is_fsdp2),
        "loss": logged(trainer, "loss"),
        "grad_norm": logged(trainer, "grad_norm"),
        "diff": logged(trainer, "rollout_corr/abs_logp_diff_max"),
        "routes_missing": logged(trainer, "rollout/routes_missing_fraction"),
        "route_flips": logged(trainer, "rollout/route_flip_fraction"),
        "route_notes": route_notes,
        "sampled": sampled,
        "pid": os.getpid(),
        "sync_reports": sync_reports,
    }


def _save_final(trainer, output_dir: str) -> None:
    """``trainer.save_model()`` as the job calls it after training, then, for the test to compare with, every
    trainable tensor as trained (gathered; on rank 0: ``trained.pt``) and the names of the checkpoint shards."""
    import torch
    from torch.distributed.tensor import DTensor

    trainer.save_model()
    trained = {}
    for name, param in trainer.accelerator.unwrap_model(trainer.model).named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            trained[name] = full.detach().clone()
    if trainer.args.should_save:
        torch.save(trained, os.path.join(output_dir, "trained.pt"))


def engine_rank(rank: int, world: int, budgets: list[int], direct: bool) -> dict:
    """Shard a tiny GPT-OSS with ``fully_shard`` per decoder layer (as accelerate's FSDP2 preparation does) and
    sample ``budgets[rank]`` tokens on this rank with the in-process engine: through ``push_weights`` (the
    engine's replica) or, ``direct``, by decoding the sharded model itself."""
    from datetime import timedelta

    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from trl_gptoss.rollout.transformers_engine import TransformersEngine
    from trl_gptoss.rollout.types import GenerationRequest
    from trl_gptoss.testing import tiny_gpt_oss

    # a group of its own with a short timeout: decoding the sharded model directly is expected to block
    group = torch.distributed.new_group(timeout=timedelta(seconds=10))
    mesh = DeviceMesh.from_group(group, "cpu")
    model = tiny_gpt_oss(seed=0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = TransformersEngine(model)
    if not direct:
        engine.push_weights(model)
    prompt = [5 + rank, 17, 42, 99, 3]
    (generation,) = engine.generate_batch([GenerationRequest(prompt, max_new_tokens=budgets[rank], seed=rank)])
    torch.distributed.barrier()
    return {"token_ids": generation.token_ids, "logprobs": generation.logprobs, "prompt": prompt}
