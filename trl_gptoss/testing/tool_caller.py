"""A tiny GPT-OSS that makes real Harmony tool calls: overfit in seconds to scripted python-tool trajectories.

Used where a real engine must produce tool calls (the vLLM "real tool call" test, the rollout benchmark).
A trajectory is a prompt, a list of python cells with the output the sandbox prints for each, and a final
answer; it is written exactly as the rollout loop will see it (the model samples the assistant turns, the
loop inserts ``<|start|>python to=assistant<|channel|>analysis<|message|>OUTPUT<|end|><|start|>assistant``),
and the model is trained on every token after the prompt until it reproduces the turns greedily.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_gptoss.harmony import Message, render_conversation, render_message


@dataclass(frozen=True)
class ToolTrajectory:
    """``prompt`` (user text), ``calls`` ((code, printed output) pairs, in order), ``final`` answer."""

    prompt: str
    calls: tuple[tuple[str, str], ...]
    final: str


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A short prompt (no system message, to keep sequences tiny) ending in ``<|start|>assistant``."""
    return render_conversation([{"role": "user", "content": text}], tokenizer, system=False, add_generation_prompt=True)


def trajectory_messages(trajectory: ToolTrajectory) -> list[Message]:
    """The Harmony messages after the prompt: (python call, python reply) per cell, then the final answer."""
    messages = []
    for code, output in trajectory.calls:
        messages.append(Message("assistant", code, channel="analysis", recipient="python", content_type="code"))
        messages.append(Message("tool", output, channel="analysis", recipient="assistant", name="python"))
    messages.append(Message("assistant", trajectory.final, channel="final"))
    return messages


def trajectory_turns(tokenizer, trajectory: ToolTrajectory) -> tuple[list[int], list[tuple[list[int], bool]]]:
    """``(prompt_ids, [(tokens, sampled), ...])``: the completion as the loop builds it, piece by piece: each
    sampled turn (``sampled=True``) and each inserted tool reply + next assistant header (``False``)."""
    prompt = prompt_ids(tokenizer, trajectory.prompt)
    header = render_conversation([], tokenizer, system=False, add_generation_prompt=True)
    messages = trajectory_messages(trajectory)
    pieces = []
    for message in messages:
        if message.role == "tool":
            pieces.append((render_message(message, tokenizer) + header, False))
        else:
            pieces.append((render_message(message, tokenizer)[len(header) :], True))
    pieces[-1][0][-1] = tokenizer.convert_tokens_to_ids("<|return|>")  # the final answer ends the rollout
    conversation = [{"role": "user", "content": trajectory.prompt}, *messages]
    full = render_conversation(conversation, tokenizer, system=False, for_training=True, drop_analysis=False)
    if full != prompt + [t for tokens, _ in pieces for t in tokens]:
        raise AssertionError("the pieces of the trajectory do not render back to the whole conversation")
    return prompt, pieces


def trajectory_ids(tokenizer, trajectory: ToolTrajectory) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, completion_ids, completion_mask)`` exactly as the rollout loop produces them."""
    prompt, pieces = trajectory_turns(tokenizer, trajectory)
    completion = [t for tokens, _ in pieces for t in tokens]
    mask = [int(sampled) for tokens, sampled in pieces for _ in tokens]
    return prompt, completion, mask


def overfit(
    model, tokenizer, trajectories, *, steps: int = 300, lr: float = 2e-3, seed: int = 0, check_every: int = 0
) -> list[float]:
    """Train ``model`` (in place, full batch, AdamW) on the sampled tokens of ``trajectories``; returns losses.

    Loss: mean next-token cross-entropy over the tokens the model will sample (``completion_mask`` 1), as an
    RL trainer would weight them; the inserted tool replies are context only. Right padding, masked out.
    ``check_every=N`` stops early once greedy decoding ``reproduces`` every trajectory (checked every N steps).
    """
    torch.manual_seed(seed)
    rows = [trajectory_ids(tokenizer, t) for t in trajectories]
    width = max(len(p) + len(c) for p, c, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, c, m) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p) : len(p) + len(c)] = torch.tensor([t if keep else -100 for t, keep in zip(c, m)])
        attention[i, : len(p) + len(c)] = 1
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if check_every and len(losses) % check_every == 0:
            model.eval()
            if all(reproduces(model, tokenizer, t) for t in trajectories):
                break
            model.train()
    model.eval()
    return losses


@torch.no_grad()
def greedy_turn(model, tokenizer, context: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of ``context`` until ``<|call|>``/``<|return|>`` (checks an overfit model offline)."""
    stops = {tokenizer.convert_tokens_to_ids("<|call|>"), tokenizer.convert_tokens_to_ids("<|return|>")}
    out = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([context + out])).logits[0, -1]
        out.append(int(logits.argmax()))
        if out[-1] in stops:
            break
    return out


def reproduces(model, tokenizer, trajectory: ToolTrajectory) -> bool:
    """Whether greedy decoding, with the tool replies inserted as the loop does, yields the whole trajectory."""
    prompt, pieces = trajectory_turns(tokenizer, trajectory)
    context = list(prompt)
    for tokens, sampled in pieces:
        if sampled and greedy_turn(model, tokenizer, context, len(tokens) + 1) != tokens:
            return False
        context += tokens
    return True
