"""Supervised warm-start of the demo model on generated Harmony demonstrations (a plain PyTorch loop).

The loss is the mean next-token cross-entropy over the tokens the model writes (``loss_mask`` 1). Only
those positions go through the 201k-entry head: the head is ~99% of the parameters and its logits dominate
CPU time, while the prompt positions need only the (cheap) transformer body. Each batch is one packed row
(no padding): the model must attend within documents only, which ``fa3_sink`` does from the position ids.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from trl_gptoss.data.arithmetic import make_problems
from trl_gptoss.demo.demonstrations import (
    MemoisedCodec,
    TokenizedDemonstration,
    completion_messages,
    tokenize_demonstration,
)


@dataclass(frozen=True)
class WarmStartConfig:
    """``tool_fraction`` of the demonstrations call the tool; the rest answer with a wrong guess."""

    num_demonstrations: int = 2048
    tool_fraction: float = 0.5
    steps: int = 300
    batch_size: int = 8
    learning_rate: float = 3e-3
    warmup_steps: int = 5
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise ValueError(f"tool_fraction must be in [0, 1], got {self.tool_fraction}")
        for name in ("num_demonstrations", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"WarmStartConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


def demonstrations(
    tokenizer, config: WarmStartConfig, *, prompt_seed_offset: int = 10_000
) -> list[TokenizedDemonstration]:
    """Tokenised demonstrations; their problems come from a seed stream disjoint from the RL prompts'."""
    from trl_gptoss.data.formats import retool_row

    codec = MemoisedCodec(tokenizer)  # the shared system/developer texts are encoded once, not per prefix
    rng = random.Random(config.seed)
    problems = make_problems(config.num_demonstrations, seed=config.seed + prompt_seed_offset)
    out = []
    for problem in problems:
        kind = "tool" if rng.random() < config.tool_fraction else "guess"
        prompt = retool_row(problem.question, str(problem.answer))["prompt"]
        out.append(tokenize_demonstration(prompt, completion_messages(problem, kind, rng), codec, kind=kind))
    return out


def pack(items: list[TokenizedDemonstration]):
    """One packed row: ``input_ids``/``position_ids`` ``[1, sum T_i]`` (positions restart per document, so
    ``fa3_sink`` attends within each document only) and ``labels`` (-100 where no loss, and on each
    document's last token, which has no next token of its own)."""
    ids, positions, labels = [], [], []
    for d in items:
        ids += d.input_ids
        positions += range(len(d.input_ids))
        labels += [t if m else -100 for t, m in zip(d.input_ids[1:], d.loss_mask[1:])] + [-100]
    as_row = lambda values: torch.tensor(values, dtype=torch.long)[None]
    return as_row(ids), as_row(positions), as_row(labels)


def masked_lm_loss(model, ids, positions, labels) -> torch.Tensor:
    """Mean cross-entropy over positions with a label, projecting only those hidden states to the vocab."""
    hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    keep = labels != -100
    logits = model.lm_head(hidden[keep])
    return torch.nn.functional.cross_entropy(logits.float(), labels[keep])


def _lr_at(step: int, config: WarmStartConfig) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.learning_rate * 0.5 * (1 + math.cos(math.pi * progress))


def warm_start(model, tokenizer, config: WarmStartConfig, *, progress: bool = True) -> list[float]:
    """Train ``model`` in place on the demonstrations; returns the loss of every step."""
    data = demonstrations(tokenizer, config)
    order = random.Random(config.seed + 1)
    # fused: one kernel over all parameters (the 201k-row embedding and head are ~99% of them)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0, fused=True)
    model.train()
    losses = []
    bar = tqdm(range(config.steps), desc="warm-start (SFT)", disable=not progress)
    for step in bar:
        batch = pack(order.sample(data, k=min(config.batch_size, len(data))))
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config)
        loss = masked_lm_loss(model, *batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def warm_started_checkpoint(tokenizer, config: WarmStartConfig, path, *, progress: bool = True):
    """The embedded model warm-started with ``config``, saved at ``path`` (returned as a ``Path``).

    ``path/warmstart.json`` records the config, the losses and the time; a later call with the same config
    reuses the checkpoint, so runs that share ``path`` start from the same policy. The warm-start stands for
    pre-training: it always trains with exact sink attention, whatever attention the RL run then uses.
    """
    import json
    import time
    from dataclasses import asdict
    from pathlib import Path

    from trl_gptoss.demo.model import build_tiny_gpt_oss, save_checkpoint

    path = Path(path)
    stamp = path / "warmstart.json"
    wanted = asdict(config)
    if stamp.is_file() and json.loads(stamp.read_text()).get("config") == wanted:
        return path
    model = build_tiny_gpt_oss(tokenizer, seed=config.seed, attn_implementation="fa3_sink")
    model.set_experts_implementation("gptoss_sequential")
    start = time.perf_counter()
    losses = warm_start(model, tokenizer, config, progress=progress)
    save_checkpoint(model, tokenizer, path)
    stamp.write_text(json.dumps({"config": wanted, "losses": losses, "seconds": time.perf_counter() - start}))
    return path
