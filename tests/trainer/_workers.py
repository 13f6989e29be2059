"""Code run inside spawned gloo processes by the trainer tests (importable by ``spawn``)."""

from __future__ import annotations

import os

from trl_gptoss.testing.distributed import set_rank_environment


def server_mode_rank(
    rank: int,
    world: int,
    server_url: str,
    state_path: str,
    output_dir: str,
    max_staleness: int = 0,
    overrides: dict | None = None,
) -> dict:
    """One rank of a 2-process server-mode run: both ranks sample from the server on their own. Returns the tool
    calls per step, the logged metrics, and (wall clock) every generation request and push of this rank.
    ``overrides``: more config fields (e.g. ``sp_size``)."""
    set_rank_environment(rank, world)
    import torch

    from tests.trainer.helpers import SYSTEM, AddTool, answer_reward, grpo_args, load_taught, logged, prompt_dataset
    from trl_gptoss.testing import harmony_tokenizer
    from trl_gptoss.trainer import GptOssGRPOTrainer

    tokenizer = harmony_tokenizer(small=True)
    model = load_taught(torch.load(state_path, weights_only=True))
    args = grpo_args(
        output_dir,
        rollout_backend="vllm_server",
        rollout_server_url=server_url,
        per_device_train_batch_size=2,
        num_generations=2,
        max_steps=3 if max_staleness else 2,
        max_staleness=max_staleness,
        learning_rate=3e-3 if max_staleness else 1e-4,
        **(overrides or {}),
    )
    trainer = GptOssGRPOTrainer(
        model,
        answer_reward,
        args=args,
        train_dataset=prompt_dataset([1, 2, 1, 2, 1, 2] if max_staleness else [1, 2]),
        processing_class=tokenizer,
        tools=[AddTool()],
        rollout_system=SYSTEM,
    )
    calls = []
    run = trainer._rollout_batch

    def counting(prompts, trainer_):
        output = run(prompts, trainer_)
        calls.append([r.num_tool_calls for r in trainer.sampler.last.rollouts])
        return output

    trainer.rollout_func = counting
    requests, pushes = time_engine(trainer.sampler.engine)
    trainer.train()
    trainer.close()
    return {
        "calls": calls,
        "diff": logged(trainer, "rollout_corr/abs_logp_diff_max"),
        "ratio": logged(trainer, "policy/ratio_max_abs_dev"),
        "staleness": logged(trainer, "rollout/staleness"),
        "requests": requests,
        "pushes": pushes,
        "sp_runner": trainer.sp_loss is not None and trainer.sp_loss.runner is not None,  # SP loss passes ran
    }


def time_engine(engine, push_delay_s: float = 0.3) -> tuple[list, list]:
    """Record the wall-clock interval of every generation request and every push, the push slowed by
    ``push_delay_s`` so that a generation running while it happens would be caught overlapping it."""
    import time

    requests, pushes = [], []
    generate, push = engine.generate, engine.push_weights

    async def timed_generate(request):
        start = time.time()
        try:
            return await generate(request)
        finally:
            requests.append((start, time.time()))

    def slow_push(model):
        start = time.time()
        time.sleep(push_delay_s)
        push(model)
        pushes.append((start, time.time()))

    engine.generate, engine.push_weights = timed_generate, slow_push
    return requests, pushes


def train_in_process_engine(
    output_dir: str, die_after_save_at: int | None = None, resume_from: str | None = None
) -> dict:
    """4 seeded steps with the in-process engine, checkpoint every 2; optionally ``os._exit`` (no cleanup,
    like a kill) right after the checkpoint of ``die_after_save_at`` is written. Returns {step: loss}."""
    from transformers import TrainerCallback

    from tests.trainer.helpers import grpo_args, length_reward, prompt_dataset
    from trl_gptoss.testing import harmony_tokenizer, tiny_gpt_oss
    from trl_gptoss.trainer import GptOssGRPOTrainer

    class DieAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == die_after_save_at:
                os._exit(137)

    args = grpo_args(
        output_dir, max_steps=4, save_strategy="steps", save_steps=2, max_completion_length=16, learning_rate=1e-2
    )
    trainer = GptOssGRPOTrainer(
        tiny_gpt_oss(seed=0),
        length_reward,
        args=args,
        train_dataset=prompt_dataset([0, 1, 2, 0, 1, 2]),
        processing_class=harmony_tokenizer(small=True),
        tools=[],
        callbacks=[DieAfterSave()] if die_after_save_at else None,
    )
    trainer.train(resume_from_checkpoint=resume_from)
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def sp_rank(rank: int, world: int, sp_size: int, output_dir: str, bf16: bool = False) -> dict:
    """One optimizer step of the in-process-engine trainer with ``sp_size`` (fp32 weights; ``bf16``: TRL's
    default autocast); the loss, every parameter's synchronised gradient (sum and sum of squares; sinks in full)
    and the dtypes layer 0's attention projections computed in while gradients were on (the loss pass)."""
    set_rank_environment(rank, world)
    import torch
    from transformers import TrainerCallback

    from tests.trainer.helpers import grpo_args, prompt_dataset, token_reward
    from trl_gptoss.testing import harmony_tokenizer, tiny_gpt_oss
    from trl_gptoss.trainer import GptOssGRPOTrainer

    grads = {}

    class KeepGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            for name, param in model.named_parameters():
                if param.grad is not None:
                    g = param.grad.double()
                    grads[name.removeprefix("module.")] = [g.sum().item(), (g * g).sum().item()]
                    if name.endswith("layers.0.self_attn.sinks"):
                        grads["sinks_full"] = g.tolist()

    args = grpo_args(
        output_dir,
        sp_size=sp_size,
        bf16=bf16,
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=24,
        entropy_coef=0.0,
        gradient_checkpointing=False,
    )
    trainer = GptOssGRPOTrainer(
        tiny_gpt_oss(seed=0),
        token_reward,
        args=args,
        train_dataset=prompt_dataset([0, 1]),
        processing_class=harmony_tokenizer(small=True),
        tools=[],
        callbacks=[KeepGrads()],
    )
    computed = set()
    projection = trainer.accelerator.unwrap_model(trainer.model).model.layers[0].self_attn.q_proj
    projection.register_forward_hook(
        lambda module, args, out: (
            computed.add(str(out.dtype).removeprefix("torch.")) if torch.is_grad_enabled() else None
        )
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    completions = [r.completion_ids for r in trainer.sampler.last.rollouts]
    return {"loss": losses, "grads": grads, "completions": completions, "loss_pass_dtypes": sorted(computed)}
