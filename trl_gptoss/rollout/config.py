"""``RolloutConfig``: budgets, sampling and tool settings of the multi-turn loop (``run_rollouts``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_gptoss.harmony import SystemContent

# The most assistant turns one conversation may take: a bound on the loop itself (each turn is a request, a
# parse and maybe a tool call), far above any useful agentic rollout. The trainer's config refuses what exceeds it.
MAX_TURNS = 1000


@dataclass
class RolloutConfig:
    """How ``run_rollouts`` samples, bounds and serves tool calls. Every default works as is.

    Budgets (all in tokens, per conversation): a turn is one ``engine.generate`` call, which ends at
    ``<|call|>``, ``<|return|>`` or its token limit. Turn ``t`` asks for
    ``min(max_completion_tokens - len(completion), engine.max_model_len - len(prompt) - len(completion))``
    new tokens, where ``completion`` already holds the earlier turns AND the inserted tool messages, so the
    whole trajectory never exceeds either bound.
    """

    max_turns: int = field(default=8, metadata={"help": "Most engine calls (assistant turns) per conversation."})
    max_completion_tokens: int = field(
        default=2048,
        metadata={"help": "Total completion budget per conversation: sampled tokens plus inserted tool tokens."},
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (> 0)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling; keep 1.0 for exact trainer logprobs."})
    top_k: int = field(default=-1, metadata={"help": "Top-k sampling, -1 = off; keep -1 for exact logprobs."})
    seed: int | None = field(
        default=0,
        metadata={
            "help": "Base seed: conversation i, turn t samples with seed derive_seed(seed, i, t). "
            "Change it every training step, and per process when several processes roll out the "
            "same prompts (e.g. (base + step) * world_size + rank), or their samples coincide; "
            "None = the engine's own stream."
        },
    )
    max_concurrent_tools: int = field(
        default=4, metadata={"help": "Tool calls running at once (worker threads; sandbox calls are processes)."}
    )
    engine_batch_window_s: float = field(
        default=0.05,
        metadata={
            "help": "How long a ready engine request waits for other conversations' requests (longer while every "
            "tool worker is busy), so that requests which become ready close together are sent together and share "
            "engine steps (see trl_gptoss.rollout.request_gate); it is sent at once when no other conversation "
            "could join. 0 = send every request as soon as it is ready."
        },
    )
    tool_output_max_chars: int = field(
        default=4000, metadata={"help": "Longest tool output the model sees per call (ToolResult.render)."}
    )
    system: SystemContent | None = field(
        default=None, metadata={"help": "System message for conversation prompts (None: Harmony's default)."}
    )

    def __post_init__(self):
        if not isinstance(self.max_turns, int) or not 1 <= self.max_turns <= MAX_TURNS:
            raise ValueError(f"RolloutConfig.max_turns must be an int in [1, {MAX_TURNS}], got {self.max_turns!r}")
        if not isinstance(self.max_completion_tokens, int) or self.max_completion_tokens < 1:
            raise ValueError(
                f"RolloutConfig.max_completion_tokens must be a positive int, got {self.max_completion_tokens!r}"
            )
        if not self.temperature > 0:
            raise ValueError(
                f"RolloutConfig.temperature must be > 0 (use a small value for near-greedy), got {self.temperature!r}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"RolloutConfig.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"RolloutConfig.top_k must be -1 (off) or a positive int, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"RolloutConfig.seed must be None or a non-negative int, got {self.seed!r}")
        if not isinstance(self.max_concurrent_tools, int) or self.max_concurrent_tools < 1:
            raise ValueError(
                f"RolloutConfig.max_concurrent_tools must be a positive int, got {self.max_concurrent_tools!r}"
            )
        window = self.engine_batch_window_s
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 <= window <= 10:
            raise ValueError(
                f"RolloutConfig.engine_batch_window_s must be a number of seconds in [0, 10] (0 = no grouping), "
                f"got {window!r}"
            )
        if not isinstance(self.tool_output_max_chars, int) or self.tool_output_max_chars < 200:
            raise ValueError(
                f"RolloutConfig.tool_output_max_chars must be an int >= 200 (room for a notice), "
                f"got {self.tool_output_max_chars!r}"
            )
        if self.system is not None and not isinstance(self.system, SystemContent):
            raise ValueError(
                f"RolloutConfig.system must be a trl_gptoss.harmony.SystemContent or None, "
                f"got {type(self.system).__name__}"
            )


def derive_seed(base: int | None, conversation: int, turn: int) -> int | None:
    """The seed of one turn: independent streams per (conversation, turn), reproducible from ``base``.

    ``numpy.random.SeedSequence`` mixes the three numbers (no collisions such as base+i+t would give);
    the result is kept below 2**31 so every engine accepts it.
    """
    if base is None:
        return None
    import numpy as np

    return int(np.random.SeedSequence([base, conversation, turn]).generate_state(1)[0]) & 0x7FFFFFFF
