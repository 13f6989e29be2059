"""Harmony demonstrations for the supervised warm-start, tokenised with the loss mask the rollouts will have.

Two kinds of demonstration, mixed so that the warm-started policy is ABLE to call the tool but does not
always do so, which leaves GRPO something visible to learn:

- ``tool``: a short analysis, ``to=python`` with ``print(<expression>)``, the tool's output, then the final
  ``\\boxed{value}``::

      <|start|>assistant<|channel|>analysis<|message|>Exact arithmetic: use python.<|end|>
      <|start|>assistant to=python<|channel|>analysis code<|message|>print(482 * 771 * 510 % 1000)<|call|>
      <|start|>python to=assistant<|channel|>...<|message|>220<|end|>                     (no loss)
      <|start|>assistant<|channel|>final<|message|>\\boxed{220}<|return|>

- ``guess``: a short analysis, then a final ``\\boxed{}`` with a plausible but wrong number (a few digits of
  the true value changed): what a model that does not use the tool produces on this task.

The tool output is rendered by the same code path as a real sandbox result (``ToolResult.to_message``), and
the whole conversation by ``render_conversation(..., for_training=True)``, so the tokens are exactly what
the rollout loop will show the model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from trl_gptoss.data.arithmetic import ArithmeticProblem
from trl_gptoss.harmony import HarmonyCodec, Message, codec_for, render_conversation
from trl_gptoss.tools import ToolResult

TOOL_ANALYSIS = "Exact arithmetic: use python."
GUESS_ANALYSIS = "Answer directly."


@dataclass(frozen=True)
class TokenizedDemonstration:
    """``input_ids`` = prompt + completion; ``loss_mask[i]`` = 1 where token ``i`` is one the model writes."""

    input_ids: list[int]
    loss_mask: list[int]
    kind: str


class MemoisedCodec(HarmonyCodec):
    """``tokenizer``'s Harmony codec (same backend, no copy) whose ``encode_text`` remembers every text.

    ``tokenize_demonstration`` renders each prefix of a conversation, so the same system, developer and user
    texts are encoded ~8 times per demonstration (~66 backend calls); encoding is a pure function of the text,
    so remembering it gives the same ids with a handful of calls. Pass it wherever a tokenizer is taken.
    """

    def __init__(self, tokenizer):
        self.__dict__.update(vars(codec_for(tokenizer)))
        self._encoded: dict[str, tuple[int, ...]] = {}

    def encode_text(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = tuple(super().encode_text(text))
        return list(ids)


def tool_message(stdout: str, channel: str = "analysis") -> Message:
    """The python tool's reply as ``run_rollouts`` inserts it: the rendered ``ToolResult`` text, authored
    by ``python``, addressed to the assistant, on the channel of the call it answers."""
    result = ToolResult(stdout=stdout, stderr="", exit_code=0, timed_out=False, truncated=False, wall_time=0.0)
    return Message("tool", result.render(), channel=channel, recipient="assistant", name="python")


def wrong_answer(value: int, rng: random.Random) -> int:
    """``value`` with 1-3 of its digits changed (never equal to ``value``, never a leading zero)."""
    digits = list(str(abs(value)))
    for position in rng.sample(range(len(digits)), k=min(len(digits), rng.randint(1, 3))):
        choices = [d for d in "0123456789" if d != digits[position] and not (position == 0 and d == "0")]
        digits[position] = rng.choice(choices)
    guess = int("".join(digits)) * (1 if value >= 0 else -1)
    return guess if guess != value else value + 1


def completion_messages(problem: ArithmeticProblem, kind: str, rng: random.Random) -> list[Message]:
    """The assistant/tool messages after the prompt for one demonstration of ``kind`` (tool | guess)."""
    if kind == "tool":
        return [
            Message("assistant", TOOL_ANALYSIS, channel="analysis"),
            Message(
                "assistant", f"print({problem.expression})", channel="analysis", recipient="python", content_type="code"
            ),
            tool_message(f"{problem.answer}\n"),
            Message("assistant", f"\\boxed{{{problem.answer}}}", channel="final"),
        ]
    if kind == "guess":
        return [
            Message("assistant", GUESS_ANALYSIS, channel="analysis"),
            Message("assistant", f"\\boxed{{{wrong_answer(problem.answer, rng)}}}", channel="final"),
        ]
    raise ValueError(f"demonstration kind must be 'tool' or 'guess', got {kind!r}")


def tokenize_demonstration(
    prompt: list[dict], messages: list[Message], tokenizer, *, kind: str, python_tool: bool = True
) -> TokenizedDemonstration:
    """Render ``prompt + messages`` and mark the tokens the model writes (``loss_mask`` 1).

    Harmony renders message by message, so message ``i`` spans ``[len(render(prefix_i)),
    len(render(prefix_{i+1})))``. Tool messages carry no loss; nor does the ``<|start|>assistant`` that
    opens the first turn (the generation prompt) or a turn after a tool message (the rollout loop inserts
    it, as a rollout's ``completion_mask`` records). A header after the model's own ``<|end|>`` is sampled,
    so it is trained.
    """

    def render(conversation, **kwargs):
        return render_conversation(conversation, tokenizer, python_tool=python_tool, drop_analysis=False, **kwargs)

    header_len = len(render(prompt, add_generation_prompt=True)) - len(render(prompt))
    ids = render(prompt + messages, for_training=True)
    bounds = [len(render(prompt + messages[:i])) for i in range(len(messages) + 1)]
    if bounds[-1] != len(ids):
        raise RuntimeError("Harmony rendering is not message-by-message; the demonstration mask would be wrong")
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message.role != "assistant":
            continue
        inserted = header_len if i == 0 or messages[i - 1].role == "tool" else 0
        mask[bounds[i] + inserted : bounds[i + 1]] = [1] * (bounds[i + 1] - bounds[i] - inserted)
    return TokenizedDemonstration(ids, mask, kind)
