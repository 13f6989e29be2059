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
