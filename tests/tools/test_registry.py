"""The one tool registry: ``trl_gptoss.tools.TOOLS`` (name -> class); one line adds a tool end to end."""

import pytest

from tests.rollout.loop_helpers import AddTool, add_call, final, scripted, user
from trl_gptoss.rollout.loop import run_rollouts
from trl_gptoss.testing import harmony_tokenizer
from trl_gptoss.tools import TOOLS, PythonTool, Tool, build_tools


def test_every_registered_tool_builds_under_its_own_name():
    assert TOOLS["python"] is PythonTool
    for name, cls in TOOLS.items():
        assert issubclass(cls, Tool) and cls.name == name
        tool = cls()
        assert tool.name == name and tool.description and f"functions.{name}" in tool.recipients


def test_unknown_names_are_refused_with_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown tool names \['calculator'\]; available: \['python'\]"):
        build_tools(["python", "calculator"])
    assert build_tools([]) == [] and build_tools(None) == []


def test_one_registry_line_adds_a_tool_to_rollouts_and_the_trainer(monkeypatch):
    """Registering a class is all it takes: ``build_tools`` (what the trainer builds ``tool_names`` with) builds it,
    the loop declares it with its own description and serves its calls."""
    monkeypatch.setitem(TOOLS, "add", AddTool)  # the one line
    tools = build_tools(["add"])
    assert [type(t) for t in tools] == [AddTool]
    tok = harmony_tokenizer()
    prompt = user("What is 2 + 3?")
    engine = scripted(tok, [(prompt, [add_call(2, 3), final("5")])], tools=tools)
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=tools)
    assert (r.final_answer, r.num_tool_calls, r.num_tool_errors) == ("5", 1, 0)
    assert "type add = " in tok.decode(r.prompt_ids) and AddTool.description in tok.decode(r.prompt_ids)
