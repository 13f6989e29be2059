"""``RequestGate`` through ``run_rollouts``: requests that become ready close together reach the engine
together, a request ready while every tool worker is busy waits for a worker to come free, nobody waits for a
conversation that cannot join, and results do not depend on the grouping."""

import time
import unittest.mock

import pytest

from tests.rollout.loop_helpers import AddTool, add_call, final, ok_result, scripted, user
from trl_gptoss.rollout import loop as rollout_loop
from trl_gptoss.rollout.config import RolloutConfig
from trl_gptoss.rollout.loop import run_rollouts
from trl_gptoss.rollout.request_gate import RequestGate
from trl_gptoss.testing import harmony_tokenizer


@pytest.fixture(scope="module")
def tok():
    return harmony_tokenizer()


class NapTool(AddTool):
    """Sleeps ``s`` seconds on its worker thread, as a sandbox run of that length would."""

    name = "nap"
    description = "Sleep."
    parameters = {"type": "object", "properties": {"s": {"type": "number"}}, "required": ["s"]}

    def _invoke(self, arguments):
        time.sleep(arguments["s"])
        return ok_result("rested")


def nap(seconds: float) -> str:
    return f'<|channel|>commentary to=functions.nap <|constrain|>json<|message|>{{"s": {seconds}}}<|call|>'


class Arrivals:
    """Wraps an engine and records when each request reached it (``perf_counter`` seconds)."""

    def __init__(self, engine):
        self.engine, self.max_model_len, self.times = engine, engine.max_model_len, []

    async def generate(self, request):
        self.times.append(time.perf_counter())
        return await self.engine.generate(request)


def _run(tok, turns, window, tools=None, workers=4):
    tools = [NapTool()] if tools is None else list(tools)
    convs = [(user(f"Task {i}"), t) for i, t in enumerate(turns)]
    engine = Arrivals(scripted(tok, convs, tools=tools))
    config = RolloutConfig(engine_batch_window_s=window, max_concurrent_tools=workers)
    start = time.perf_counter()
    rollouts = run_rollouts(engine, [c[0] for c in convs], tokenizer=tok, tools=list(tools), config=config)
    return rollouts, [t - start for t in engine.times], time.perf_counter() - start


def test_requests_ready_close_together_reach_the_engine_together(tok):
    turns = [[nap(0.0), final("a")], [nap(0.15), final("b")]]
    (a, b), times, _ = _run(tok, turns, window=1.0)
    assert (a.final_answer, b.final_answer) == ("a", "b")
    second = sorted(times[2:])
    assert second[1] - second[0] < 0.05, f"second turns reached the engine {second[1] - second[0]:.3f} s apart"
    assert second[0] > 0.14  # the quick one waited for the slow one's tool
    _, times, _ = _run(tok, turns, window=0.0)  # without grouping each goes as soon as it is ready
    second = sorted(times[2:])
    assert second[1] - second[0] > 0.1


def test_nobody_waits_for_a_conversation_that_cannot_join(tok):
    """A 10 s window, yet the batch takes well under a second: the group goes as soon as every unfinished
    conversation is waiting or generating, and a finished conversation is never waited for."""
    turns = [[nap(0.0), final("a")], [nap(0.2), final("b")], [final("c")]]
    rollouts, times, wall = _run(tok, turns, window=10.0)
    assert [r.final_answer for r in rollouts] == ["a", "b", "c"]
    assert wall < 3.0, f"the batch took {wall:.2f} s"
    assert max(times[:3]) < 0.5  # first turns: everyone ready at once, sent at once


def test_results_do_not_depend_on_grouping(tok):
    calls = [0, 3, 1, 5, 2, 0]
    turns = [[add_call(i, k) for k in range(n)] + [final(f"answer {i}")] for i, n in enumerate(calls)]
    runs = [_run(tok, turns, window, tools=(AddTool(),))[0] for window in (0.0, 0.05)]
    for ungrouped, grouped in zip(*runs):
        assert grouped.completion_ids == ungrouped.completion_ids
        assert grouped.completion_mask == ungrouped.completion_mask
        assert grouped.logprobs == ungrouped.logprobs
        assert (grouped.num_tool_calls, grouped.final_answer) == (ungrouped.num_tool_calls, ungrouped.final_answer)


class WindowOnlyGate(RequestGate):
    """The gate without its tool rule (as ``benchmarks/bench_rollouts.py`` measures it)."""

    def __init__(self, engine, conversations, window, tool_workers=None):
        super().__init__(engine, conversations, window, tool_workers=None)


def test_a_request_ready_while_every_tool_worker_is_busy_waits_for_one_to_come_free(tok):
    """Two workers: conversation 0's call ends at once and its worker goes to conversation 2, so both workers
    nap 0.4 s. Conversation 0's second turn is held past the 0.05 s window until one of them comes back, and goes
    to the engine together with it; with the window rule alone it goes after 0.05 s, on its own."""
    turns = [[nap(0.0), final("a")], [nap(0.4), final("b")], [nap(0.4), final("c")]]
    rollouts, times, wall = _run(tok, turns, window=0.05, workers=2)
    assert [r.final_answer for r in rollouts] == ["a", "b", "c"]
    second = sorted(times[3:])
    assert second[0] > 0.35, f"conversation 0's second turn went at {second[0]:.3f} s, while both workers napped"
    assert second[1] - second[0] < 0.05, f"it went {second[1] - second[0]:.3f} s before the next one back"
    assert wall < 3.0, f"the batch took {wall:.2f} s"
    with unittest.mock.patch.object(rollout_loop, "RequestGate", WindowOnlyGate):
        _, times, _ = _run(tok, turns, window=0.05, workers=2)
    second = sorted(times[3:])
    assert second[0] < 0.3 and second[1] - second[0] > 0.1


def test_free_tool_workers_leave_the_window_rule_alone(tok):
    """The same calls with three workers, one idle once conversation 0 is back: its second turn goes when the
    0.05 s window ends, without waiting for the napping ones."""
    turns = [[nap(0.0), final("a")], [nap(0.4), final("b")], [nap(0.4), final("c")]]
    rollouts, times, _ = _run(tok, turns, window=0.05, workers=3)
    assert [r.final_answer for r in rollouts] == ["a", "b", "c"]
    second = sorted(times[3:])
    assert second[0] < 0.3 and second[1] - second[0] > 0.1


def test_results_do_not_depend_on_the_tool_rule(tok):
    """Many calls on one worker (every worker busy whenever a call runs): the same rollouts as without grouping."""
    calls = [0, 3, 1, 5, 2, 0]
    turns = [[add_call(i, k) for k in range(n)] + [final(f"answer {i}")] for i, n in enumerate(calls)]
    held = _run(tok, turns, 0.05, tools=(AddTool(),), workers=1)[0]
    ungrouped = _run(tok, turns, 0.0, tools=(AddTool(),), workers=1)[0]
    for a, b in zip(held, ungrouped):
        assert (a.completion_ids, a.completion_mask, a.logprobs) == (b.completion_ids, b.completion_mask, b.logprobs)
        assert (a.num_tool_calls, a.final_answer) == (b.num_tool_calls, b.final_answer)


def test_gate_rejects_zero_tool_workers():
    with pytest.raises(ValueError, match="tool_workers"):
        RequestGate(object(), 1, 0.05, tool_workers=0)


def test_engine_failure_while_others_wait_aborts_the_batch(tok):
    """Conversation 0 waits (10 s window) for conversation 1, whose next request fails (its script has no
    second turn): the error ends the batch at once, nothing hangs at the gate."""
    start = time.perf_counter()
    with pytest.raises(IndexError, match="the script has 1 turns"):
        _run(tok, [[nap(0.0), final("a")], [nap(0.2)]], window=10.0)
    assert time.perf_counter() - start < 3.0


@pytest.mark.parametrize("window", [-0.1, 11, True, "0.05"])
def test_config_rejects_bad_windows(window):
    with pytest.raises(ValueError, match="engine_batch_window_s"):
        RolloutConfig(engine_batch_window_s=window)
