"""The builtin python tool behaves like the stateful notebook its Harmony description promises."""

import pytest

from tests.rollout.loop_helpers import final, scripted, user
from trl_gptoss.harmony import render_conversation
from trl_gptoss.harmony.messages import PYTHON_TOOL_DESCRIPTION
from trl_gptoss.rollout.config import RolloutConfig
from trl_gptoss.rollout.loop import run_rollouts
from trl_gptoss.rollout.python_session import PythonSession, notebook_program, python_code_from_body
from trl_gptoss.testing import harmony_tokenizer
from trl_gptoss.tools import PythonSandbox, PythonTool, SandboxLimits


@pytest.fixture(scope="module")
def python_tool():
    return PythonTool(PythonSandbox(SandboxLimits(wall_seconds=5.0, cpu_seconds=5)))


@pytest.fixture(scope="module")
def tok():
    return harmony_tokenizer()


def test_state_persists_last_expression_echoes_and_replays_are_silent(python_tool):
    session = PythonSession(python_tool)
    first = session.run("import os\nx = 6 * 7\nprint('side effect', flush=True)\nos.write(1, b'raw fd\\n')\nx")
    assert first.ok and first.stdout == "side effect\nraw fd\n42\n"  # the replay below must silence both
    second = session.run("y = x + 1\ny")
    assert second.ok and second.stdout == "43\n" and second.stderr == ""
    assert session.run("None").stdout == ""  # like a notebook, None is not echoed


def test_errors_show_only_the_models_code_and_the_state_before_them_survives(python_tool):
    session = PythonSession(python_tool)
    session.run("a = [1, 2]")
    failed = session.run("b = 5\na[7]")
    assert failed.exit_code == 1 and "IndexError" in failed.stderr
    assert 'File "<cell 1>", line 2' in failed.stderr and "a[7]" in failed.stderr and "_run" not in failed.stderr
    after = session.run("print(a, b)")  # notebook semantics: b was assigned before the error
    assert after.ok and after.stdout == "[1, 2] 5\n"
    syntax = session.run("def broken(:")
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr


def test_a_cell_that_hits_a_limit_is_not_replayed(python_tool):
    session = PythonSession(python_tool)
    session.run("n = 3")
    runaway = session.run("while True:\n    pass")
    assert runaway.timed_out and len(session.cells) == 1
    again = session.run("n * 2")
    assert again.ok and again.stdout == "6\n"


def test_sessions_are_independent(python_tool):
    one, two = PythonSession(python_tool), PythonSession(python_tool)
    one.run("secret = 1")
    leaked = two.run("secret")
    assert leaked.exit_code == 1 and "NameError" in leaked.stderr


def test_function_form_body_and_bad_input(python_tool):
    assert python_code_from_body(python_tool, '{"code": "print(1)"}') == "print(1)"
    assert python_code_from_body(python_tool, "{1: 2}") == "{1: 2}"  # a dict literal is code
    with pytest.raises(ValueError, match="unknown arguments"):
        python_code_from_body(python_tool, '{"code": "1", "extra": 2}')
    with pytest.raises(ValueError, match="must be str"):
        notebook_program([], b"print(1)")
    with pytest.raises(ValueError, match="PythonTool"):
        PythonSession(object())


def _python_turn(code: str) -> str:
    return (
        "<|channel|>analysis<|message|>Let me run code.<|end|><|start|>assistant to=python<|channel|>analysis "
        f"code<|message|>{code}<|call|>"
    )


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "stateless"])
def test_builtin_python_calls_in_a_rollout(tok, python_tool, stateful):
    prompt = user("Compute 6 * 7, then add one.")
    turns = [_python_turn("x = 6 * 7\nprint(x)"), _python_turn("print(x + 1)"), final("43")]
    engine = scripted(tok, [(prompt, turns)], tools=[python_tool], python_tool=True)
    config = RolloutConfig(python_stateful=stateful)
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=[python_tool], config=config)
    replies = [m for m in r.messages if m.role == "tool"]
    assert [(m.name, m.recipient, m.channel) for m in replies] == [("python", "assistant", "analysis")] * 2
    assert replies[0].text == "42"
    if stateful:
        assert replies[1].text == "43" and r.num_tool_errors == 0
    else:
        assert "NameError: name 'x' is not defined" in replies[1].text and r.num_tool_errors == 1
    assert PYTHON_TOOL_DESCRIPTION.split(". ")[0] in tok.decode(r.prompt_ids)  # declared as the builtin tool
    rendered = render_conversation(prompt + r.messages, tok, python_tool=True, for_training=True, drop_analysis=False)
    assert rendered == r.prompt_ids + r.completion_ids


def test_functions_python_with_a_json_body_shares_the_session(tok, python_tool):
    prompt = user("Use the function form.")
    call = '<|channel|>commentary to=functions.python <|constrain|>json<|message|>{"code": "%s"}<|call|>'
    turns = [call % "z = 5", _python_turn("z * 3"), final("15")]
    engine = scripted(tok, [(prompt, turns)], tools=[python_tool], python_tool=True)
    (r,) = run_rollouts(engine, [prompt], tokenizer=tok, tools=[python_tool])
    first, second = [m.text for m in r.messages if m.role == "tool"]
    assert "no output" in first and second == "15"
    assert r.num_tool_errors == 0 and r.final_answer == "15"


def test_files_on_the_promised_drive_persist_across_cells(python_tool):
    # The description says /mnt/data persists user files: each call is a fresh sandbox, the replay rebuilds them.
    assert "/mnt/data" in PYTHON_TOOL_DESCRIPTION
    session = PythonSession(python_tool)
    assert session.run("open('/mnt/data/n.txt', 'w').write('41')").ok
    later = session.run("int(open('/mnt/data/n.txt').read()) + 1")
    assert later.ok and later.stdout == "42\n", later.render()
