"""The python tool in a rollout: what the prompt tells the model is what the sandbox runs, in every setting."""

import json

import pytest

from tests.rollout.loop_helpers import final, scripted, user
from trl_gptoss.harmony import SystemContent, ToolNamespace, codec_for, render_conversation
from trl_gptoss.harmony.tokens import END
from trl_gptoss.rollout.config import RolloutConfig
from trl_gptoss.rollout.loop import run_rollouts
from trl_gptoss.testing import harmony_tokenizer
from trl_gptoss.tools import PythonSandbox, PythonTool, SandboxLimits
from trl_gptoss.tools.python_tool import (
    NOTEBOOK_BUILTIN_DESCRIPTION,
    NOTEBOOK_FUNCTION_DESCRIPTION,
    STATELESS_DESCRIPTION,
)

SETTINGS = [(True, True), (True, False), (False, True), (False, False)]
SETTING_IDS = ["stateful-builtin", "stateful-function", "stateless-builtin", "stateless-function"]


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(SandboxLimits(wall_seconds=5.0, cpu_seconds=5))


@pytest.fixture(scope="module")
def tok():
    return harmony_tokenizer()


def _python_turn(code: str) -> str:
    return (
        "<|channel|>analysis<|message|>Let me run code.<|end|><|start|>assistant to=python<|channel|>analysis "
        f"code<|message|>{code}<|call|>"
    )


def _function_turn(code: str) -> str:
    body = json.dumps({"code": code})
    return f"<|channel|>commentary to=functions.python <|constrain|>json<|message|>{body}<|call|>"


def _system_and_developer(tok, prompt_ids) -> tuple[str, str]:
    """The decoded system message and the rest of the prompt (developer message and the conversation)."""
    codec = codec_for(tok)
    first_end = prompt_ids.index(codec.special(END))
    return tok.decode(prompt_ids[: first_end + 1]), tok.decode(prompt_ids[first_end + 1 :])


@pytest.mark.parametrize("stateful, builtin", SETTINGS, ids=SETTING_IDS)
def test_the_prompt_describes_the_tool_that_runs(tok, sandbox, stateful, builtin):
    """Every setting: the description in the prompt is the running tool's own, in the message its form
    belongs to, and the sandbox behaves as that description says (state kept or not)."""
    tool = PythonTool(sandbox, stateful=stateful, builtin=builtin)
    turn = _python_turn if builtin else _function_turn
    prompt = user("Compute 6 * 7, then add one.")
    turns = [turn("x = 6 * 7\nprint(x)"), turn("print(x + 1)"), final("43")]
    engine = scripted(tok, [(prompt, turns)], tools=[tool])
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=[tool])

    system, rest = _system_and_developer(tok, r.prompt_ids)
    expected = {
        (True, True): NOTEBOOK_BUILTIN_DESCRIPTION,
        (True, False): NOTEBOOK_FUNCTION_DESCRIPTION,
        (False, True): STATELESS_DESCRIPTION,
        (False, False): STATELESS_DESCRIPTION,
    }[(stateful, builtin)]
    assert tool.description == expected
    where = system if builtin else rest
    assert all(line in where for line in expected.splitlines() if line), where
    assert ("## python" in system) == builtin and ("type python = " in rest) == (not builtin)
    others = {NOTEBOOK_BUILTIN_DESCRIPTION, NOTEBOOK_FUNCTION_DESCRIPTION, STATELESS_DESCRIPTION} - {expected}
    assert not any(other.splitlines()[0] in tok.decode(r.prompt_ids) for other in others)
    assert ("stateful" in expected) == stateful and ("stateless" in expected) == (not stateful)

    replies = [m.text for m in r.messages if m.role == "tool"]
    assert replies[0] == "42"
    if stateful:
        assert replies[1] == "43" and r.num_tool_errors == 0
    else:
        assert "NameError: name 'x' is not defined" in replies[1] and r.num_tool_errors == 1


def test_builtin_python_round_trips_through_the_harmony_renderer(tok, sandbox):
    """The default tool is declared exactly as openai-harmony's ``python_tool=True`` declares it."""
    tool = PythonTool(sandbox)
    prompt = user("Compute 6 * 7, then add one.")
    turns = [_python_turn("x = 6 * 7\nprint(x)"), _python_turn("print(x + 1)"), final("43")]
    engine = scripted(tok, [(prompt, turns)], tools=[tool])
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=[tool])
    replies = [m for m in r.messages if m.role == "tool"]
    assert [(m.name, m.recipient, m.channel) for m in replies] == [("python", "assistant", "analysis")] * 2
    assert r.prompt_ids == render_conversation(prompt, tok, python_tool=True, add_generation_prompt=True)
    rendered = render_conversation(prompt + r.messages, tok, python_tool=True, for_training=True, drop_analysis=False)
    assert rendered == r.prompt_ids + r.completion_ids


def test_functions_python_with_a_json_body_shares_the_session(tok, sandbox):
    tool = PythonTool(sandbox)
    prompt = user("Use the function form.")
    turns = [_function_turn("z = 5"), _python_turn("z * 3"), final("15")]
    engine = scripted(tok, [(prompt, turns)], tools=[tool])
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=[tool])
    first, second = [m.text for m in r.messages if m.role == "tool"]
    assert "no output" in first and second == "15"
    assert r.num_tool_errors == 0 and r.final_answer == "15"


def test_the_builtin_declaration_appends_to_a_custom_system_message(tok, sandbox):
    tool = PythonTool(sandbox, stateful=False)
    system = SystemContent(reasoning_effort="high")
    prompt = user("hi")
    engine = scripted(tok, [(prompt, [final("hello")])], tools=[tool])
    expected = render_conversation(
        prompt,
        tok,
        system=SystemContent(reasoning_effort="high", tools=(ToolNamespace("python", STATELESS_DESCRIPTION),)),
        add_generation_prompt=True,
    )
    engine.scripts[tuple(expected)] = engine.scripts.pop(next(iter(engine.scripts)))
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=[tool], config=RolloutConfig(system=system))
    assert r.prompt_ids == expected and "Reasoning: high" in tok.decode(r.prompt_ids)
