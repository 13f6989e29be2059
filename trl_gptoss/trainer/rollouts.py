"""The trainer's side of the rollout layer: a batch's sampling settings, its metrics, TRL's tensors.

TRL's ``rollout_func`` contract is what ``GptOssGRPOTrainer`` fills: ``prompt_ids``, ``completion_ids``,
``logprobs`` (the engine's, 0.0 on inserted tool tokens), ``env_mask`` (becomes TRL's ``tool_mask``: 1 on
sampled tokens, 0 on inserted ones, so tool output is attended but never trained on) and extra columns that
TRL merges into the rows the reward functions receive.
"""

from __future__ import annotations

import torch

from trl_gptoss.rollout.config import RolloutConfig, derive_seed
from trl_gptoss.rollout.types import Rollout

# Extra columns every reward function receives (aligned with ``completions``).
ROLLOUT_COLUMNS = ("final_answer", "messages", "num_turns", "num_tool_calls", "num_tool_errors", "stop_reason")


def rollout_config(args, step: int, process_index: int, system=None) -> RolloutConfig:
    """Sampling settings of one generation round. The seed differs per optimizer step and per process (so
    processes never sample the same continuations) and is reproducible from ``args.seed``."""
    return RolloutConfig(
        max_turns=args.max_turns_per_conversation,
        max_completion_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.engine_top_k,
        seed=derive_seed(args.seed, step, process_index),
        system=system,
    )


def rollout_metrics(rollouts: list[Rollout], accelerator) -> dict[str, float]:
    """The batch's conversation metrics over every process."""
    local = [[r.num_turns, r.num_tool_calls, r.num_tool_errors, r.final_answer is not None] for r in rollouts]
    stats = accelerator.gather(torch.tensor(local, dtype=torch.float32, device=accelerator.device))
    calls = stats[:, 1].sum().item()
    return {
        "rollout/num_turns_mean": stats[:, 0].mean().item(),
        "tools/call_frequency": calls / max(len(stats), 1),
        "tools/failure_frequency": stats[:, 2].sum().item() / calls if calls else 0.0,
        "rollout/final_answer_fraction": stats[:, 3].mean().item(),
    }


def rollouts_to_trl(rollouts: list[Rollout]) -> dict:
    """TRL ``rollout_func`` output for one batch (lists aligned with the prompts)."""
    output = {
        "prompt_ids": [r.prompt_ids for r in rollouts],
        "completion_ids": [r.completion_ids for r in rollouts],
        "logprobs": [r.logprobs for r in rollouts],
        "env_mask": [r.completion_mask for r in rollouts],
    }
    for column in ROLLOUT_COLUMNS:
        output[column] = [_column_value(r, column) for r in rollouts]
    return output


def _column_value(rollout: Rollout, column: str):
    value = getattr(rollout, column)
    if column == "messages":
        return [_message_dict(m) for m in value]
    return value


def _message_dict(message) -> dict:
    if isinstance(message, dict):
        return message
    to_dict = getattr(message, "to_dict", None)
    return (
        to_dict()
        if callable(to_dict)
        else {"role": getattr(message, "role", None), "content": getattr(message, "content", None)}
    )


def final_answer_completions(answers: list[str | None], conversational: bool = True) -> list:
    """What TRL passes as ``completions`` to rewards: the final answer ("" when the conversation ended without
    one), so answer-matching rewards never see tool output or analysis. Conversational prompts get one
    assistant message per completion, plain-text prompts the text itself (TRL's two formats)."""
    texts = [answer or "" for answer in answers]
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
