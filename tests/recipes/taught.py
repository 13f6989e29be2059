"""The rehearsals' stand-in for a pre-trained GPT-OSS: a tiny model over the real o200k Harmony vocabulary,
taught to solve each rehearsed prompt about half the time.

Why taught: GRPO's advantage is a reward minus its group's mean. A random tiny model never writes a final answer,
so every completion of a group gets the same reward, every advantage is 0, and the loss has no gradient at all:
the weights would not move whatever the precision, and the rehearsals could not tell fp32 masters from bf16
ones that round the updates away. So the model is taught, on the first ``ROWS`` rows of each task's shipped
samples, two demonstrations per prompt:

- ``right``: ReTool prompts call the python tool (``print("<truth>")``, its reply rendered as the sandbox's is)
  and then answer ``\\boxed{<truth>}``; GSM8K prompts answer ``\\boxed{<truth>}``; VerifyIf prompts answer with
  the best-scoring of a few short texts;
- ``wrong``: a final answer the task's own reward scores lower (``\\boxed{0}``, or the worst-scoring text).

Taught to both, the model samples each about half the time (checked by ``answer_odds``), so groups of 4 mix
rewards. Everything is rendered as the rollout loop renders it (``tokenize_demonstration``; a test compares each
prompt with what the loop itself sends an engine, ``loop_prompt_ids``).
"""

from __future__ import annotations

import math

import torch

from trl_gptoss.data.tasks import TASKS
from trl_gptoss.demo.demonstrations import tokenize_demonstration, tool_message
from trl_gptoss.harmony import Message
from trl_gptoss.harmony.tokens import CALL, RETURN

ROWS = 2  # prompts per task the rehearsals use (their dataset_limit): enough for 2 distinct prompts per batch
TASK_NAMES = ("retool", "gsm8k", "verifyif")
SHAPE = dict(hidden_size=64, intermediate_size=128, sliding_window=128, initializer_range=0.1)
VERIFYIF_TEXTS = ("no.", "NO.", "Yes. Yes. Yes.", "yes, yes")


def _score(task: str, row: dict, text: str) -> float:
    columns = {k: [v] for k, v in row.items() if k != "prompt"}
    (reward,) = TASKS[task].reward(completions=[text], **columns)
    return reward


def _finals(task: str, row: dict) -> tuple[str, str]:
    """The ``right`` and ``wrong`` final answers of one row: the truth (boxed) and ``\\boxed{0}`` for the math
    tasks; for VerifyIf, the best- and worst-scoring of a few short texts (partial credit is enough: the two
    rewards only have to differ, and short answers are learnt in few steps)."""
    if task != "verifyif":
        from trl_gptoss.rewards.math import gsm8k_answer

        truth = gsm8k_answer(row["answer"]) if task == "gsm8k" else row["answer"]
        return f"\\boxed{{{truth}}}", "\\boxed{0}"
    ranked = sorted(VERIFYIF_TEXTS, key=lambda text: _score(task, row, text))
    return ranked[-1], ranked[0]


def _messages(task: str, final: str, kind: str) -> list[Message]:
    answer = Message("assistant", final, channel="final")
    if task != "retool" or kind == "wrong":
        return [answer]
    truth = final.removeprefix("\\boxed{").removesuffix("}")
    call = Message("assistant", f'print("{truth}")', channel="analysis", recipient="python", content_type="code")
    return [call, tool_message(f"{truth}\n"), answer]


def demonstrations(tokenizer) -> list[dict]:
    """Every (task, row, kind) demonstration: ``input_ids``, ``loss_mask``, the reward of its final answer and
    the prompt (conversation) it answers."""
    out = []
    for task in TASK_NAMES:
        rows = TASKS[task].load(source="sample", limit=ROWS)
        for index, row in enumerate(rows):
            finals = dict(zip(("right", "wrong"), _finals(task, row)))
            python = bool(TASKS[task].tools)
            for kind in ("right", "wrong"):
                messages = _messages(task, finals[kind], kind)
                demo = tokenize_demonstration(row["prompt"], messages, tokenizer, kind=kind, python_tool=python)
                reward = _score(task, row, finals[kind])
                out.append(
                    dict(
                        task=task,
                        row=index,
                        kind=kind,
                        reward=reward,
                        prompt=row["prompt"],
                        input_ids=demo.input_ids,
                        loss_mask=demo.loss_mask,
                    )
                )
    for task, index in {(d["task"], d["row"]) for d in out}:
        right, wrong = (d["reward"] for d in out if (d["task"], d["row"]) == (task, index))
        assert right > wrong, f"{task} row {index}: the right demonstration must out-score the wrong one"
    return out


def _masked_loss(model, ids: torch.Tensor, attention: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over labelled positions only (the 201k-wide head sees a few dozen rows per step)."""
    hidden = model.model(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
    keep = labels != -100
    return torch.nn.functional.cross_entropy(model.lm_head(hidden[keep]).float(), labels[keep])


def _batch(demos: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(d["input_ids"]) for d in demos)
    ids = torch.zeros(len(demos), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, d in enumerate(demos):
        n = len(d["input_ids"])
        ids[i, :n] = torch.tensor(d["input_ids"])
        attention[i, :n] = 1
        target = torch.tensor(d["input_ids"][1:] + [-100])
        labels[i, :n] = torch.where(torch.tensor(d["loss_mask"][1:] + [0], dtype=torch.bool), target, -100)
    return ids, attention, labels


def teach(tokenizer, *, steps: int = 35, lr: float = 1e-2, seed: int = 0):
    """The taught fp32 model (``fa3_sink``, ``gptoss_sequential``) and its last loss."""
    import trl_gptoss  # noqa: F401  (registers fa3_sink and gptoss_sequential)
    from trl_gptoss.testing import tiny_gpt_oss

    stops = [tokenizer.convert_tokens_to_ids(t) for t in (RETURN, CALL)]
    model = tiny_gpt_oss(
        seed=seed,
        attn_implementation="fa3_sink",
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stops,
        bos_token_id=tokenizer.bos_token_id,
        **SHAPE,
    )
    model.set_experts_implementation("gptoss_sequential")
    demos = demonstrations(tokenizer)
    batch = _batch(demos)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    model.train()
    loss = torch.tensor(math.nan)
    for _ in range(steps):
        loss = _masked_loss(model, *batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return model.eval(), loss.item()


class _Recorder:
    """A rollout engine that records the prompt it is asked to continue and answers ``<|return|>`` at once."""

    max_model_len = 4096

    def __init__(self, tokenizer):
        self.stop, self.prompts = tokenizer.convert_tokens_to_ids(RETURN), []

    async def generate(self, request):
        from trl_gptoss.rollout.types import Generation

        self.prompts.append(list(request.prompt_ids))
        return Generation([self.stop], [0.0], "stop")


def loop_prompt_ids(tokenizer, task: str, prompt: list[dict]) -> list[int]:
    """The token ids the rollout loop sends the engine for ``prompt`` with the task's tools and Harmony's default
    system message, as the trainer's rollouts render it."""
    from trl_gptoss.rollout.loop import run_rollouts
    from trl_gptoss.tools import build_tools

    engine = _Recorder(tokenizer)
    run_rollouts(engine, [prompt], tokenizer=tokenizer, tools=build_tools(list(TASKS[task].tools)))
    return engine.prompts[0]


@torch.no_grad()
def answer_odds(model, tokenizer) -> dict[tuple[str, int], float]:
    """``P(right) / (P(right) + P(wrong))`` of every taught prompt's two demonstrations (teacher-forced, the
    sampled tokens only): how often the policy is expected to earn the higher reward."""
    demos = demonstrations(tokenizer)
    ids, attention, labels = _batch(demos)
    hidden = model.model(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
    keep = labels != -100
    logps = torch.log_softmax(model.lm_head(hidden[keep]).float(), -1).gather(1, labels[keep][:, None])[:, 0]
    totals = torch.zeros(len(demos)).index_add_(0, keep.nonzero()[:, 0], logps)
    odds = {}
    for i, d in enumerate(demos):
        odds.setdefault((d["task"], d["row"]), {})[d["kind"]] = float(totals[i])
    return {key: 1 / (1 + math.exp(v["wrong"] - v["right"])) for key, v in odds.items()}
