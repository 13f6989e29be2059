"""The multi-turn Harmony tool loop: every conversation advances on its own.

Each conversation is one asyncio task that repeats::

    generate (until <|call|> / <|return|> / token budget)  ->  parse the turn (trl_gptoss.harmony)
    -> run the tool call on a worker thread  ->  append <|start|>{tool} to=assistant ...<|end|><|start|>assistant
       as token ids (completion_mask 0)  ->  generate again

so a conversation that makes one call never waits for one that makes six, and the engine keeps sampling
while tools run; when calls queue for a worker, the conversation with the most calls so far goes first
(``ToolBox``). Requests that become ready close together are sent together (``RequestGate``: at most
``config.engine_batch_window_s`` of waiting, longer only while every tool worker is busy), so they share engine
steps. Sampled tokens are kept exactly as the engine returned them (never decoded and re-tokenised); only the
inserted tool messages are rendered by ``trl_gptoss.harmony.render_message``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

from trl_gptoss.harmony import (
    Message,
    SystemContent,
    ToolNamespace,
    codec_for,
    parse_completion,
    render_conversation,
    render_message,
)
from trl_gptoss.harmony.tokens import CALL, RETURN, START
from trl_gptoss.rollout.config import RolloutConfig, derive_seed
from trl_gptoss.rollout.event_loop import run_to_completion
from trl_gptoss.rollout.request_gate import RequestGate
from trl_gptoss.rollout.routes import TrajectoryRoutes
from trl_gptoss.rollout.tool_calls import ToolBox
from trl_gptoss.rollout.types import GenerationRequest, Rollout, RolloutEngine
from trl_gptoss.tools import ToolSet


def run_rollouts(
    engine: RolloutEngine, prompts, *, tokenizer, tools=(), config: RolloutConfig | None = None
) -> list[Rollout]:
    """Roll out every prompt to the end (final answer, turn limit, token budget or unreadable output).

    ``prompts``: conversations (lists of chat dicts / harmony ``Message``s, rendered with ``tools`` and
    ``config.system``, ending in ``<|start|>assistant``) or token-id lists that already end in
    ``<|start|>assistant``. Returns one ``Rollout`` per prompt, in order. Runs its own event loop; from
    async code use ``await arun_rollouts(...)``. An engine error aborts the whole batch (it is re-raised
    after the other conversations are cancelled): no partial batch is ever returned as complete.
    """
    return run_to_completion(arun_rollouts(engine, prompts, tokenizer=tokenizer, tools=tools, config=config))


async def arun_rollouts(
    engine: RolloutEngine, prompts, *, tokenizer, tools=(), config: RolloutConfig | None = None
) -> list[Rollout]:
    """The async form of ``run_rollouts``: one task per conversation, all on the running loop."""
    config = config if config is not None else RolloutConfig()
    context = _engine_context(engine)
    toolset = ToolSet(list(tools or ()))
    codec = codec_for(tokenizer)
    prompt_ids = [_prompt_ids(p, i, codec, toolset, config) for i, p in enumerate(prompts)]
    for index, ids in enumerate(prompt_ids):
        if len(ids) >= context:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens, which leaves no room for a completion in the "
                f"engine's context (max_model_len={context}); shorten it or serve a longer context"
            )
    with ThreadPoolExecutor(max_workers=config.max_concurrent_tools, thread_name_prefix="rollout-tool") as pool:
        toolbox = ToolBox(toolset, executor=pool, workers=config.max_concurrent_tools)
        gate = RequestGate(
            engine, len(prompt_ids), config.engine_batch_window_s, tool_workers=config.max_concurrent_tools
        )
        conversations = [
            _Conversation(i, ids, gate, context, codec, toolbox, config) for i, ids in enumerate(prompt_ids)
        ]
        tasks = [asyncio.create_task(c.run(), name=f"rollout-{c.index}") for c in conversations]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


def _engine_context(engine) -> int:
    context = getattr(engine, "max_model_len", None)
    if not isinstance(context, int) or isinstance(context, bool) or context < 2:
        raise ValueError(f"engine.max_model_len must be the engine's context length (an int >= 2), got {context!r}")
    return context


def _assistant_header(codec) -> list[int]:
    return [codec.special(START)] + codec.encode_text("assistant")


def _prompt_ids(prompt, index: int, codec, toolset: ToolSet, config: RolloutConfig) -> list[int]:
    """Token ids of one prompt; conversations are rendered with the tools and a generation prompt."""
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(f"prompt {index} must be a non-empty list of chat dicts or of token ids, got {prompt!r:.80}")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        header = _assistant_header(codec)
        if ids[-len(header) :] != header:
            raise ValueError(
                f"token-id prompt {index} must end with <|start|>assistant (render it with "
                "add_generation_prompt=True); the completion is parsed as an assistant message"
            )
        return ids
    # Each tool is declared with its own description: builtins in the system message, the rest as functions.
    system = config.system if config.system is not None else SystemContent()
    builtins = tuple(ToolNamespace(tool.builtin_name, tool.description) for tool in toolset.builtins)
    if builtins:
        system = dataclasses.replace(system, tools=system.tools + builtins)
    return render_conversation(list(prompt), codec, tools=toolset.functions, system=system, add_generation_prompt=True)


class _Conversation:
    """The state of one rollout while it runs; ``run()`` drives it to the end and returns the ``Rollout``."""

    def __init__(self, index, prompt_ids, gate: RequestGate, context, codec, toolbox: ToolBox, config: RolloutConfig):
        self.index, self.prompt_ids, self.engine, self.codec = index, prompt_ids, gate, codec
        self.toolbox, self.config = toolbox, config
        self.sessions = toolbox.new_sessions()
        self.limit = min(config.max_completion_tokens, context - len(prompt_ids))  # completion tokens allowed
        self.call_id, self.return_id = codec.special(CALL), codec.special(RETURN)
        self.routes = TrajectoryRoutes()
        self.rollout = Rollout(
            prompt_ids=list(prompt_ids),
            completion_ids=[],
            completion_mask=[],
            logprobs=[],
            messages=[],
            final_answer=None,
            num_turns=0,
            num_tool_calls=0,
            num_tool_errors=0,
            stop_reason="length",
            timings={"generate_s": 0.0, "tool_s": 0.0, "total_s": 0.0},
        )

    async def run(self) -> Rollout:
        start = time.perf_counter()
        stop = None
        try:
            while stop is None:
                stop = await self._turn()
        finally:
            self.engine.finished()
        self.rollout.stop_reason = stop
        self.rollout.timings["total_s"] = time.perf_counter() - start
        self.rollout.routes = self.routes.finish(len(self.prompt_ids) + len(self.rollout.completion_ids))
        self.rollout.route_notes = self.routes.notes
        return self.rollout

    async def _turn(self) -> str | None:
        """One engine call and, when it ends in a tool call, the tool's reply. Returns a stop reason or None."""
        r, config = self.rollout, self.config
        room = self.limit - len(r.completion_ids)
        if room < 1:
            return "length"
        request = GenerationRequest(
            prompt_ids=r.prompt_ids + r.completion_ids,
            max_new_tokens=room,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            seed=derive_seed(config.seed, self.index, r.num_turns),
            stop_token_ids=(self.return_id, self.call_id),
        )
        t0 = time.perf_counter()
        generation = await self.engine.generate(request)
        r.timings["generate_s"] += time.perf_counter() - t0
        tokens = list(generation.token_ids)
        if not 1 <= len(tokens) <= room:
            raise RuntimeError(
                f"engine returned {len(tokens)} tokens for max_new_tokens={room} (conversation "
                f"{self.index}, turn {r.num_turns}); it breaks the RolloutEngine contract"
            )
        if generation.routes is not None or generation.routes_note is not None:
            self.routes.add_turn(generation.routes, generation.routes_note, r.num_turns + 1)
        r.completion_ids += tokens
        r.completion_mask += [1] * len(tokens)
        r.logprobs += [float(x) for x in generation.logprobs]
        r.num_turns += 1
        parsed = parse_completion(tokens, self.codec, role="assistant")
        r.messages += parsed.messages
        r.errors += [f"turn {r.num_turns}: {e.kind}: {e.message}" for e in parsed.errors if e.kind != "truncated"]
        if tokens[-1] not in (self.call_id, self.return_id):
            return "length" if generation.finish_reason == "length" or len(tokens) == room else "parse_error"
        last_complete = bool(parsed.spans) and parsed.spans[-1][1] == len(tokens)
        if not last_complete:
            return "parse_error"  # the action message itself (final answer or call) could not be read
        if tokens[-1] == self.return_id:
            r.final_answer = parsed.final_answer
            return "final"
        last = parsed.messages[-1]
        if last.role != "assistant" or not last.recipient or last.recipient == "all":
            r.errors.append(f"turn {r.num_turns}: <|call|> ends a message without a recipient")
            return "parse_error"
        if r.num_turns >= config.max_turns:
            return "max_turns"  # the model would never see this call's result
        return await self._answer_call(parsed.tool_calls[-1])

    async def _answer_call(self, call) -> str | None:
        r = self.rollout
        t0 = time.perf_counter()
        with self.engine.in_tool_call():
            result = await self.toolbox.run(call, self.sessions, priority=r.num_tool_calls)
        r.timings["tool_s"] += time.perf_counter() - t0
        r.num_tool_calls += 1
        if not result.ok:
            r.num_tool_errors += 1
            r.errors.append(f"turn {r.num_turns}: tool {call.recipient}: {result.stderr.strip()[:200]}")
        reply = Message(
            "tool",
            result.render(self.config.tool_output_max_chars),
            channel=call.channel or "commentary",
            recipient="assistant",
            name=call.recipient,
        )
        inserted = render_message(reply, self.codec) + _assistant_header(self.codec)
        if len(r.completion_ids) + len(inserted) >= self.limit:
            return "length"  # no room left to append the reply and sample at least one token after it
        r.completion_ids += inserted
        r.completion_mask += [0] * len(inserted)
        r.logprobs += [0.0] * len(inserted)
        r.messages.append(reply)
        return None
