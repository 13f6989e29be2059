"""``ScriptedEngine``: a ``RolloutEngine`` that answers from token scripts, for testing the rollout loop.

A script is the list of turns one conversation will sample, as token ids. The engine finds the script by
the registered prompt the request starts with, and the turn by counting the ``<|call|>`` tokens sampled so
far (each earlier turn ended in one), so it keeps no per-conversation state and concurrent conversations
cannot mix up. Every request is recorded, and an optional delay per request and per token lets tests make
some conversations slow.
"""

from __future__ import annotations

import asyncio
import re

from trl_gptoss.harmony import codec_for
from trl_gptoss.harmony.tokens import CALL
from trl_gptoss.rollout.types import Generation, GenerationRequest

_SPECIAL = re.compile(r"(<\|[a-z_0-9]+\|>)")


def harmony_ids(tokenizer, text: str) -> list[int]:
    """Token ids of Harmony text written with special tokens spelled out, e.g.
    ``"<|channel|>analysis<|message|>Let me check.<|end|>"``: the ``<|...|>`` names become special ids, the
    text between them is encoded ordinarily, piece by piece (as the Harmony renderer does)."""
    codec = codec_for(tokenizer)
    ids = []
    for piece in _SPECIAL.split(text):
        if piece in codec.special_ids:
            ids.append(codec.special(piece))
        elif _SPECIAL.fullmatch(piece):
            raise ValueError(f"{piece} is not a Harmony special token")
        else:
            ids += codec.encode_text(piece)
    return ids


def scripted_logprob(token_id: int, position: int) -> float:
    """The log-prob the scripted engine reports for a token: distinct, negative, reproducible."""
    return -((token_id * 31 + position * 7) % 997 + 1) / 1000.0


class ScriptedEngine:
    """Samples nothing: turn ``t`` of the conversation that starts with ``prompt`` returns ``scripts[prompt][t]``.

    Honours ``max_new_tokens`` (cut there, ``finish_reason="length"``) and ``stop_token_ids`` (output ends
    at the first stop token, which is included, ``"stop"``). A script turn that ends without a stop token
    and fits reads as an engine-side end of sequence (``"stop"``). Past the end of a script it raises.
    """

    def __init__(
        self,
        tokenizer,
        scripts: dict[tuple[int, ...], list[list[int]]],
        *,
        max_model_len: int = 4096,
        delay_s: float = 0.0,
        delay_per_token_s: float = 0.0,
    ):
        self.codec = codec_for(tokenizer)
        self.scripts = {tuple(prompt): [list(turn) for turn in turns] for prompt, turns in scripts.items()}
        self.max_model_len = max_model_len
        self.delay_s, self.delay_per_token_s = delay_s, delay_per_token_s
        self.requests: list[GenerationRequest] = []
        self.active = 0  # requests being answered right now
        self.max_active = 0

    def _script_for(self, prompt_ids: list[int]) -> tuple[list[list[int]], int]:
        matches = [p for p in self.scripts if tuple(prompt_ids[: len(p)]) == p]
        if not matches:
            raise KeyError(f"no script registered for a prompt starting with {prompt_ids[:12]}...")
        prompt = max(matches, key=len)
        turn = prompt_ids[len(prompt) :].count(self.codec.special(CALL))
        return self.scripts[prompt], turn

    async def generate(self, request: GenerationRequest) -> Generation:
        self.requests.append(request)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            turns, turn = self._script_for(request.prompt_ids)
            if turn >= len(turns):
                raise IndexError(f"the script has {len(turns)} turns; turn {turn} was requested")
            tokens, reason = self._cut(turns[turn], request)
            await asyncio.sleep(self.delay_s + self.delay_per_token_s * len(tokens))
        finally:
            self.active -= 1
        start = len(request.prompt_ids)
        return Generation(tokens, [scripted_logprob(t, start + i) for i, t in enumerate(tokens)], reason)

    @staticmethod
    def _cut(script: list[int], request: GenerationRequest) -> tuple[list[int], str]:
        for i, token in enumerate(script[: request.max_new_tokens]):
            if token in request.stop_token_ids:
                return script[: i + 1], "stop"
        if len(script) > request.max_new_tokens:
            return script[: request.max_new_tokens], "length"
        return list(script), "stop"

    def push_weights(self, model) -> None:
        """Nothing to push: the scripts do not depend on weights."""
