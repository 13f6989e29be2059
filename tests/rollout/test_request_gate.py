"""``RequestGate`` through ``run_rollouts``: requests that become ready close together reach the engine
together, nobody waits for a conversation that cannot join, and results do not depend on the grouping."""

import time

import pytest

from tests.rollout.loop_helpers import AddTool, add_call, final, ok_result, scripted, user
from trl_gptoss.rollout.config import RolloutConfig
from trl_gptoss.rollout.loop import run_rollouts
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


def _run(tok, turns, window, tools=None):
    tools = [NapTool()] if tools is None else list(tools)
    convs = [(user(f"Task {i}"), t) for i, t in enumerate(turns)]
    engine = Arrivals(scripted(tok, convs, tools=tools))
    config = RolloutConfig(engine_batch_window_s=window)
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
