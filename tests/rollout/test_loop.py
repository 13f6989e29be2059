"""The multi-turn loop against scripted engines with the real o200k Harmony tokenizer."""

import asyncio
import time

import pytest

from tests.rollout.loop_helpers import (
    AddTool,
    BrokenTool,
    MissingFileTool,
    add_call,
    final,
    ok_result,
    scripted,
    user,
)
from trl_gptoss.harmony import Message, codec_for, render_conversation, render_message
from trl_gptoss.rollout.config import RolloutConfig, derive_seed
from trl_gptoss.rollout.loop import arun_rollouts, run_rollouts
from trl_gptoss.testing import harmony_tokenizer
from trl_gptoss.testing.engines import harmony_ids, scripted_logprob


@pytest.fixture(scope="module")
def tok():
    return harmony_tokenizer()


def _roundtrip(tok, prompt, rollout, **render_kwargs):
    return render_conversation(prompt + rollout.messages, tok, for_training=True, drop_analysis=False, **render_kwargs)


def _inserted_runs(rollout):
    """The maximal runs of completion_mask == 0, as (start, end) pairs."""
    runs, start = [], None
    for i, m in enumerate(rollout.completion_mask + [1]):
        if m == 0 and start is None:
            start = i
        elif m == 1 and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_one_call_then_final_masks_logprobs_and_roundtrip(tok):
    prompt = user("What is 2 + 3?")
    engine = scripted(tok, [(prompt, [add_call(2, 3), final("5")])], tools=[AddTool()])
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=[AddTool()])
    assert (r.stop_reason, r.final_answer, r.num_turns, r.num_tool_calls, r.num_tool_errors) == ("final", "5", 2, 1, 0)
    turn1, turn2 = harmony_ids(tok, add_call(2, 3)), harmony_ids(tok, final("5"))
    reply = harmony_ids(
        tok, "<|start|>functions.add to=assistant<|channel|>commentary<|message|>5<|end|><|start|>assistant"
    )
    assert r.completion_ids == turn1 + reply + turn2  # sampled ids verbatim, only the reply inserted
    assert r.completion_mask == [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2)
    start = len(r.prompt_ids)
    expected_lp = (
        [scripted_logprob(t, start + i) for i, t in enumerate(turn1)]
        + [0.0] * len(reply)
        + [scripted_logprob(t, start + len(turn1) + len(reply) + i) for i, t in enumerate(turn2)]
    )
    assert r.logprobs == expected_lp
    assert [m.role for m in r.messages] == ["assistant", "assistant", "tool", "assistant", "assistant"]
    assert _roundtrip(tok, prompt, r, tools=[AddTool()]) == r.prompt_ids + r.completion_ids
    assert set(r.timings) == {"generate_s", "tool_s", "total_s"} and r.timings["total_s"] > 0


def test_inserted_tokens_are_exactly_the_rendered_replies(tok):
    prompt = user("Add a few numbers.")
    turns = [add_call(1, 2), add_call(30, 40), add_call(-5, 5), final("done")]
    engine = scripted(tok, [(prompt, turns)], tools=[AddTool()])
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=[AddTool()])
    codec = codec_for(tok)
    header = harmony_ids(tok, "<|start|>assistant")
    runs = _inserted_runs(r)
    replies = [m for m in r.messages if m.role == "tool"]
    assert [m.text for m in replies] == ["3", "70", "0"] and len(runs) == 3
    for (a, b), reply in zip(runs, replies):
        assert r.completion_ids[a:b] == render_message(reply, codec) + header
        assert all(lp == 0.0 for lp in r.logprobs[a:b])
    assert sum(r.completion_mask) == sum(len(harmony_ids(tok, t)) for t in turns)
    assert _roundtrip(tok, prompt, r, tools=[AddTool()]) == r.prompt_ids + r.completion_ids


def test_gpt_oss_header_order_channel_first(tok):
    """``<|channel|>commentary to=functions.add <|constrain|>json``: parsed, served, ids kept as sampled."""
    prompt = user("1 + 1?")
    turn1 = add_call(1, 1, order=2)
    engine = scripted(tok, [(prompt, [turn1, final("2")])], tools=[AddTool()])
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=[AddTool()])
    assert (r.stop_reason, r.num_tool_calls, r.num_tool_errors, r.final_answer) == ("final", 1, 0, "2")
    call = r.messages[0]
    assert (call.recipient, call.channel, call.content_type) == ("functions.add", "commentary", "<|constrain|>json")
    assert r.messages[1].name == "functions.add" and r.messages[1].text == "2"
    assert r.completion_ids[: len(harmony_ids(tok, turn1))] == harmony_ids(tok, turn1)
    # Re-rendering writes the recipient first: the ids differ, which is why training uses completion_ids.
    assert _roundtrip(tok, prompt, r, tools=[AddTool()]) != r.prompt_ids + r.completion_ids


@pytest.mark.parametrize(
    "turn,error",
    [
        ('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": <|call|>', "not valid JSON"),
        ('<|channel|>commentary to=functions.add json<|message|>{"a": 1}<|call|>', "missing arguments ['b']"),
        (
            "<|channel|>commentary to=functions.nope json<|message|>{}<|call|>",
            "no tool named 'functions.nope'; available: functions.add, functions.broken, functions.read_log",
        ),
        (
            "<|channel|>commentary to=functions.broken json<|message|>{}<|call|>",
            "tool 'broken' failed: RuntimeError: disk on fire",
        ),
        (
            "<|channel|>commentary to=functions.read_log json<|message|>{}<|call|>",
            "tool 'read_log' failed: FileNotFoundError: [Errno 2] No such file or directory",
        ),
        ("<|channel|>analysis to=python code<|message|>print(1)<|call|>", "no tool named 'python'"),
    ],
    ids=["bad-json", "missing-arg", "unknown-tool", "tool-raises", "tool-raises-oserror", "python-not-offered"],
)
def test_bad_calls_become_error_replies_and_the_rollout_goes_on(tok, turn, error):
    tools = [AddTool(), BrokenTool(), MissingFileTool()]
    prompt = user("Try it.")
    engine = scripted(tok, [(prompt, [turn, final("gave up")])], tools=tools)
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=tools)
    assert (r.stop_reason, r.num_tool_calls, r.num_tool_errors, r.final_answer) == ("final", 1, 1, "gave up")
    reply = next(m for m in r.messages if m.role == "tool")
    assert error in reply.text and error in r.errors[0]
    assert len(engine.requests) == 2  # the model saw the error and answered


@pytest.mark.parametrize(
    "turn,detail",
    [
        ("<|channel|>analysis<|message|>thinking<|call|>", "without a recipient"),
        ("<|channel|>final extra words here<|message|>x<|return|>", "malformed_header"),
        ("<|channel|>final<|message|>no stop token at all", None),
    ],
    ids=["call-without-recipient", "malformed-final-header", "engine-eos-without-stop"],
)
def test_unreadable_turns_stop_with_parse_error(tok, turn, detail):
    prompt = user("Hi")
    engine = scripted(tok, [(prompt, [turn])])
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok)
    assert (r.stop_reason, r.num_turns, r.num_tool_calls, r.final_answer) == ("parse_error", 1, 0, None)
    assert r.completion_ids == harmony_ids(tok, turn) and all(r.completion_mask)
    if detail:
        assert any(detail in e for e in r.errors), r.errors


def test_max_turns_stops_before_running_the_last_call(tok):
    prompt = user("Loop forever")
    engine = scripted(tok, [(prompt, [add_call(1, 1), add_call(2, 2), final("never")])], tools=[AddTool()])
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=[AddTool()], config=RolloutConfig(max_turns=2))
    assert (r.stop_reason, r.num_turns, r.num_tool_calls) == ("max_turns", 2, 1)
    assert r.completion_ids[-1] == codec_for(tok).special("<|call|>") and r.completion_mask[-1] == 1
    assert _roundtrip(tok, prompt, r, tools=[AddTool()]) == r.prompt_ids + r.completion_ids


def test_completion_budget_counts_tool_tokens_and_each_turn_asks_for_what_is_left(tok):
    prompt = user("Budget")
    turns = [add_call(1, 2), add_call(3, 4), final("a long answer " * 20)]
    engine = scripted(tok, [(prompt, turns)], tools=[AddTool()])
    budget = 130
    (r,) = run_rollouts(
        engine, [prompt], tokenizer=tok, tools=[AddTool()], config=RolloutConfig(max_completion_tokens=budget)
    )
    assert r.stop_reason == "length" and len(r.completion_ids) == budget and r.num_tool_calls == 2
    asked = [q.max_new_tokens for q in engine.requests]
    prompt_len = len(r.prompt_ids)
    assert asked[0] == budget
    for q, max_new in zip(engine.requests, asked):
        assert max_new == budget - (len(q.prompt_ids) - prompt_len)  # what is left after sampled + inserted


def test_engine_context_bounds_the_turn(tok):
    prompt = user("Context")
    engine = scripted(tok, [(prompt, [final("x " * 100)])])
    engine.max_model_len = len(render_conversation(prompt, tok, add_generation_prompt=True)) + 7
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok)
    assert engine.requests[0].max_new_tokens == 7 and len(r.completion_ids) == 7 and r.stop_reason == "length"


def test_tool_reply_that_does_not_fit_ends_the_rollout(tok):
    prompt = user("Tight")
    engine = scripted(tok, [(prompt, [add_call(1, 2), final("3")])], tools=[AddTool()])
    turn1 = len(harmony_ids(tok, add_call(1, 2)))
    (r,) = run_rollouts(
        engine, [prompt], tokenizer=tok, tools=[AddTool()], config=RolloutConfig(max_completion_tokens=turn1 + 5)
    )
    assert (r.stop_reason, r.num_tool_calls, len(r.completion_ids)) == ("length", 1, turn1)
    assert all(r.completion_mask) and len(engine.requests) == 1


def test_prompt_longer_than_the_context_is_refused_before_any_generation(tok):
    prompt = user("word " * 50)
    engine = scripted(tok, [(prompt, [final("x")])], max_model_len=40)
    with pytest.raises(ValueError, match=r"prompt 0 has \d+ tokens.*max_model_len=40"):
        run_rollouts(engine, [prompt], tokenizer=tok)
    assert engine.requests == []


def test_parallel_conversations_with_different_numbers_of_calls(tok):
    calls = [0, 3, 1, 5, 2, 0]
    convs = [
        (user(f"Task {i}"), [add_call(i, k) for k in range(n)] + [final(f"answer {i}")]) for i, n in enumerate(calls)
    ]
    engine = scripted(tok, convs, tools=[AddTool()], delay_s=0.02)
    rollouts = run_rollouts(engine, [c[0] for c in convs], tokenizer=tok, tools=[AddTool()])
    assert engine.max_active == len(calls)  # every conversation had a request in flight at once
    for i, (r, n) in enumerate(zip(rollouts, calls)):
        assert (r.stop_reason, r.final_answer, r.num_tool_calls, r.num_turns) == ("final", f"answer {i}", n, n + 1)
        assert [m.text for m in r.messages if m.role == "tool"] == [str(i + k) for k in range(n)]
        assert _roundtrip(tok, convs[i][0], r, tools=[AddTool()]) == r.prompt_ids + r.completion_ids
    # Per-conversation, per-turn seeds derived from the base seed.
    assert len({q.seed for q in engine.requests}) == len(engine.requests) == sum(calls) + len(calls)
    for i, r in enumerate(rollouts):
        mine = [q for q in engine.requests if q.prompt_ids[: len(r.prompt_ids)] == r.prompt_ids]
        assert [q.seed for q in mine] == [derive_seed(0, i, t) for t in range(r.num_turns)]


def test_token_id_prompts_and_their_validation(tok):
    prompt = user("ids")
    engine = scripted(tok, [(prompt, [final("ok")])])
    ids = render_conversation(prompt, tok, add_generation_prompt=True)
    (r,) = run_rollouts(engine, [ids], tokenizer=tok)
    assert r.prompt_ids == ids and r.final_answer == "ok"
    with pytest.raises(ValueError, match="must end with <\\|start\\|>assistant"):
        run_rollouts(engine, [ids[:-1]], tokenizer=tok)


def test_engine_failure_aborts_the_batch(tok):
    engine = scripted(tok, [(user("known"), [add_call(1, 1), final("2")])], tools=[AddTool()], delay_s=0.01)
    with pytest.raises(KeyError, match="no script registered"):
        run_rollouts(engine, [user("known"), user("unknown")], tokenizer=tok, tools=[AddTool()])


def test_sync_form_refuses_a_running_loop_async_form_works(tok):
    prompt = user("async")
    engine = scripted(tok, [(prompt, [final("yes")])])

    async def inside():
        with pytest.raises(RuntimeError, match="await arun_rollouts"):
            run_rollouts(engine, [prompt], tokenizer=tok)
        return await arun_rollouts(engine, [prompt], tokenizer=tok)

    (r,) = asyncio.run(inside())
    assert r.final_answer == "yes"


def test_messages_are_harmony_messages(tok):
    prompt = user("types")
    engine = scripted(tok, [(prompt, [final("t")])])
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok)
    assert all(isinstance(m, Message) for m in r.messages)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_turns=0), "max_turns"),
        (dict(max_completion_tokens=0), "max_completion_tokens"),
        (dict(temperature=0.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(max_concurrent_tools=0), "max_concurrent_tools"),
        (dict(tool_output_max_chars=10), "tool_output_max_chars"),
        (dict(system="hi"), "SystemContent"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**kwargs)


def test_other_conversations_keep_generating_while_a_tool_runs(tok):
    """A tool that only returns once the engine has served another conversation's four turns: it can only
    finish if the loop keeps generating (and running other tools) while it blocks a worker thread."""
    seen = []  # the engine's request log, filled in below

    class WaitTool(AddTool):
        name, parameters = "wait", {"type": "object", "properties": {}}

        def _invoke(self, arguments):
            deadline = time.monotonic() + 30
            while len(seen[0]) < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            return ok_result(f"saw {len(seen[0])} requests")

    tools = [AddTool(), WaitTool()]
    slow_prompt, busy_prompt = user("slow"), user("busy")
    engine = scripted(
        tok,
        [
            (slow_prompt, ["<|channel|>commentary to=functions.wait json<|message|>{}<|call|>", final("waited")]),
            (busy_prompt, [add_call(1, 1), add_call(2, 2), add_call(3, 3), final("busy done")]),
        ],
        tools=tools,
    )
    seen.append(engine.requests)
    slow, busy = run_rollouts(engine, [slow_prompt, busy_prompt], tokenizer=tok, tools=tools)
    assert busy.final_answer == "busy done" and busy.num_tool_calls == 3
    assert slow.final_answer == "waited" and slow.messages[1].text == "saw 5 requests"
