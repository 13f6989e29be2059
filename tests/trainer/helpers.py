"""Shared pieces of the trainer tests: a tiny GPT-OSS taught to call a tool, datasets, configs.

``taught_model`` overfits a tiny model on real trajectories (the rollout loop runs each scripted turn and the
real ``add`` tool answers), so sampling from it -- in-process or in vLLM -- makes real tool calls: the prompt
``PROMPTS[k]`` calls the tool ``k`` times before answering. A short system message keeps prompts ~140 tokens.
"""

from __future__ import annotations

import torch
from datasets import Dataset

from tests.rollout.loop_helpers import AddTool
from trl_gptoss.harmony import SystemContent, render_conversation
from trl_gptoss.rollout.config import RolloutConfig
from trl_gptoss.rollout.loop import run_rollouts
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.testing.engines import ScriptedEngine, harmony_ids

PROMPTS = {0: "Say four.", 1: "Add two and two.", 2: "Add two and two, twice."}
SYSTEM = SystemContent(
    model_identity=None,
    reasoning_effort=None,
    knowledge_cutoff=None,
    valid_channels=("analysis", "commentary", "final"),
    channel_required=False,
)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _add_call(a: int, b: int) -> str:
    return f'<|channel|>commentary to=functions.add <|constrain|>json<|message|>{{"a": {a}, "b": {b}}}<|call|>'


def _final(text: str) -> str:
    return f"<|channel|>final<|message|>{text}<|return|>"


def scripted_turns(calls: int) -> list[str]:
    return [_add_call(2, 2) for _ in range(calls)] + [_final("4")]


def real_trajectories(tokenizer, tools) -> list:
    """One Rollout per entry of PROMPTS, produced by the real loop and the real tool."""
    scripts = {}
    for calls, text in PROMPTS.items():
        ids = render_conversation(user(text), tokenizer, tools=tools, system=SYSTEM, add_generation_prompt=True)
        scripts[tuple(ids)] = [harmony_ids(tokenizer, t) for t in scripted_turns(calls)]
    engine = ScriptedEngine(tokenizer, scripts, max_model_len=1024)
    rollouts = run_rollouts(
        engine,
        [user(t) for t in PROMPTS.values()],
        tokenizer=tokenizer,
        tools=tools,
        config=RolloutConfig(max_completion_tokens=200, seed=0, system=SYSTEM),
    )
    for calls, rollout in zip(PROMPTS, rollouts):
        assert rollout.num_tool_calls == calls and rollout.num_tool_errors == 0, rollout
    return rollouts


def taught_model(tokenizer, *, steps: int = 300, seed: int = 0, **overrides):
    """A tiny GPT-OSS that reproduces ``real_trajectories`` (loss on sampled tokens only)."""
    rollouts = real_trajectories(tokenizer, [AddTool()])
    model = tiny_gpt_oss(seed=seed, **overrides).train()
    rows = [r.prompt_ids + r.completion_ids for r in rollouts]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (row, r) in enumerate(zip(rows, rollouts)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        completion = torch.tensor(r.completion_ids)
        sampled = torch.tensor(r.completion_mask, dtype=torch.bool)
        labels[i, len(r.prompt_ids) : len(row)] = torch.where(sampled, completion, torch.full_like(completion, -100))
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    return model.eval(), loss.item()


def prompt_dataset(calls: list[int], answer: str = "4") -> Dataset:
    return Dataset.from_list([{"prompt": user(PROMPTS[c]), "answer": answer} for c in calls])


def answer_reward(completions, answer, **kwargs) -> list[float]:
    """1 when the final answer equals the ``answer`` column (what ``completions`` carries), else 0."""
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]


def load_taught(state_dict, **overrides):
    """A fresh copy of the taught model (every test trains its own)."""
    model = tiny_gpt_oss(seed=0, **overrides)
    model.load_state_dict(state_dict)
    return model


def lora_config():
    """LoRA on attention and on both expert parameters (what ``retool_gpt_oss_20b_lora`` targets)."""
    from peft import LoraConfig

    return LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )


def grpo_args(output_dir, **overrides):
    """A small, seeded, CPU config: 2 prompts x 2 generations per step, short completions, no saving."""
    from trl_gptoss.trainer import GptOssGRPOConfig

    fields = dict(
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=96,
        max_steps=2,
        learning_rate=1e-4,
        logging_steps=1,
        report_to=[],
        seed=0,
        save_strategy="no",
        temperature=1.0,
        entropy_coef=0.01,
        dataloader_num_workers=0,
        rollout_backend="transformers",
        vllm_importance_sampling_mode="token_truncate",
        max_tool_calling_iterations=3,
    )
    fields.update(overrides)
    return GptOssGRPOConfig(str(output_dir), **fields)


def logged(trainer, key: str) -> list[float]:
    """The values of ``key`` over the training steps (one per logged step)."""
    return [h[key] for h in trainer.state.log_history if key in h]


def length_reward(completions, **kwargs) -> list[float]:
    """Varies across samples of one prompt, so advantages (and the policy gradient) are not all zero."""
    return [float(len(c[0]["content"]) % 5) for c in completions]


def token_reward(completions, completion_ids, **kwargs) -> list[float]:
    """A function of the sampled tokens (random models rarely reach a final answer): varied advantages."""
    return [float(sum(ids) % 7) for ids in completion_ids]
