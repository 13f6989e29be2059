"""The rollout layer's contract: what an engine is asked, what it answers, what a finished rollout holds.

Every engine (in-process transformers, vLLM server over HTTP, a scripted one in tests) implements
``async generate(GenerationRequest) -> Generation``; the multi-turn loop (``run_rollouts``) only speaks this
interface, so each conversation can advance on its own while others wait for the engine or a tool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from trl_gptoss.harmony.messages import Message

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length"]
StopReason = Literal["final", "max_turns", "length", "parse_error"]


@dataclass(frozen=True)
class GenerationRequest:
    """One sampling call: continue ``prompt_ids`` by at most ``max_new_tokens`` tokens.

    ``stop_token_ids`` end sampling (the stop token is part of the output, as Harmony's ``<|call|>`` and
    ``<|return|>`` must be trained on). ``seed=None`` samples from the engine's own stream.
    """

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("GenerationRequest.prompt_ids is empty; render the conversation first")
        if self.max_new_tokens < 1:
            raise ValueError(f"GenerationRequest.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"GenerationRequest.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"GenerationRequest.top_p must be in (0, 1], got {self.top_p}")

    def check_fits(self, max_model_len: int) -> None:
        """Raise when prompt + ``max_new_tokens`` exceeds an engine's context (every engine asks the same)."""
        total = len(self.prompt_ids) + self.max_new_tokens
        if total > max_model_len:
            raise ValueError(
                f"prompt ({len(self.prompt_ids)} tokens) + max_new_tokens "
                f"({self.max_new_tokens}) = {total} exceeds max_model_len={max_model_len}"
            )


@dataclass(frozen=True)
class Generation:
    """What the engine sampled: token ids (stop token included), their log-probs, why sampling ended.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the distribution actually sampled from
    (temperature applied; vLLM's ``processed_logprobs``), which is what the trainer recomputes.
    ``routes``: when the engine was asked for them (``enable_routes``), the experts its routers chose for every
    position of prompt + sampled tokens (``trl_gptoss.rollout.routes``), else ``None``, with ``routes_note``
    saying why when they were asked for.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    routes: torch.Tensor | None = None
    routes_note: str | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Generation has {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that samples continuations of token-id prompts.

    ``max_model_len`` is the engine's context length (prompt + completion); ``push_weights(model)`` makes
    the engine sample from ``model``'s current parameters (a no-op where the engine shares them).
    """

    max_model_len: int

    async def generate(self, request: GenerationRequest) -> Generation: ...

    def push_weights(self, model) -> None: ...


@dataclass
class Rollout:
    """One finished multi-turn conversation, ready for the trainer.

    ``completion_ids`` holds everything after the prompt: sampled tokens (``completion_mask`` 1) and the
    tool messages and next ``<|start|>assistant`` headers the loop inserted (``completion_mask`` 0).
    ``logprobs`` are the engine's for sampled tokens and 0.0 for inserted ones.

    ``messages``: the conversation after the prompt as harmony ``Message``s, in order: the assistant messages
    parsed from each turn and the tool replies the loop inserted. When the model wrote canonical Harmony
    (recipient before channel, text tokenised the usual way), ``render_conversation(prompt + messages,
    for_training=True, drop_analysis=False)`` gives exactly ``prompt_ids + completion_ids``; train on the
    ids, never on a re-rendering (GPT-OSS also writes ``<|channel|>commentary to=functions.X``, which
    renders back in the other header order). ``stop_reason``: ``final`` (``<|return|>``), ``max_turns``
    (a call in the last allowed turn), ``length`` (token budget or context full), ``parse_error`` (the
    turn's last message is not readable Harmony). ``num_tool_errors`` counts calls whose reply is an error
    (unknown tool, bad arguments, the tool raised, the sandboxed program failed). ``errors`` describes
    each tool error and parse problem. ``timings``: ``generate_s`` (awaiting the engine, including the wait
    for other conversations' requests, ``RolloutConfig.engine_batch_window_s``), ``tool_s``
    (awaiting tools, queueing included), ``total_s``, in seconds. ``routes``: the engine's experts for every
    position of ``prompt_ids + completion_ids`` (``int16 [positions, layers, top_k]``, ``-1`` where the engine
    reported none) when routes were asked for; ``route_notes`` says why positions lack them.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    logprobs: list[float]
    messages: list[Message]
    final_answer: str | None
    num_turns: int
    num_tool_calls: int
    num_tool_errors: int
    stop_reason: StopReason
    timings: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    routes: torch.Tensor | None = None
    route_notes: list[str] = field(default_factory=list)
