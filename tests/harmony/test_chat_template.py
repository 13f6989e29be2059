"""The Harmony chat template renders exactly what ``render_conversation`` renders, token for token."""

import pytest
from transformers import AutoTokenizer

from tests.harmony.corpus import random_conversation
from trl_gptoss.harmony import SystemContent, harmony_tokenizer, render_conversation
from trl_gptoss.rollout.loop import run_rollouts
from trl_gptoss.testing import harmony_tokenizer as fixture_tokenizer
from trl_gptoss.testing.engines import ScriptedEngine, harmony_ids
from trl_gptoss.tools import PythonTool

N_CONVERSATIONS = 120
OPTIONS = [{}, {"add_generation_prompt": True}, {"for_training": True}, {"drop_analysis": False}]


@pytest.fixture(scope="module")
def tok():
    return harmony_tokenizer()


def _without_special_strings(value):
    """Text that spells a special token (``<|end|>``) stays text for render_conversation, but a chat template
    is one string, which the tokenizer splits on special tokens: keep such text out of the exact comparison."""
    if isinstance(value, str):
        return value.replace("<|", "<")
    if isinstance(value, list):
        return [_without_special_strings(v) for v in value]
    if isinstance(value, dict):
        return {k: _without_special_strings(v) for k, v in value.items()}
    return value


def _system_kwargs(system: SystemContent) -> dict:
    return {
        "model_identity": system.model_identity,
        "reasoning_effort": system.reasoning_effort,
        "knowledge_cutoff": system.knowledge_cutoff,
        "conversation_start_date": system.conversation_start_date,
        "valid_channels": list(system.valid_channels),
        "channel_required": system.channel_required,
    }


def _template_ids(tok, conversation, tools, **kwargs):
    return tok.apply_chat_template(conversation, tools=tools or None, tokenize=True, return_dict=False, **kwargs)


def test_corpus_matches_render_conversation(tok):
    checked = 0
    for seed in range(N_CONVERSATIONS):
        case = random_conversation(seed)
        conversation = _without_special_strings(case["conversation"])
        for options in OPTIONS:
            expected = render_conversation(
                conversation,
                tok,
                tools=case["tools"],
                system=case["system"],
                python_tool=case["python_tool"],
                **options,
            )
            got = _template_ids(
                tok,
                conversation,
                case["tools"],
                python_tool=case["python_tool"],
                **_system_kwargs(case["system"]),
                **options,
            )
            assert got == expected, f"seed {seed} {options}:\n{tok.decode(expected)!r}\n{tok.decode(got)!r}"
            checked += 1
    assert checked == N_CONVERSATIONS * len(OPTIONS)


def test_defaults_openai_tools_and_tool_call_dicts(tok):
    """What TRL and HF users pass: OpenAI-style tools, assistant ``tool_calls`` with dict arguments, and a
    tool reply, with every system option left at its default."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now.\nIn Celsius.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "reasoning_content": "Need the tool.",
            "content": "Checking.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "name": "get_weather", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 °C."},
    ]
    for options in OPTIONS:
        expected = render_conversation(conversation, tok, tools=[tool], **options)
        assert _template_ids(tok, conversation, [tool], **options) == expected, options
    text = tok.apply_chat_template(conversation[:2], tools=[tool], tokenize=False, add_generation_prompt=True)
    assert "type get_weather = (_: {\n// City name\ncity: string,\n}) => any;" in text
    assert text.endswith("<|start|>user<|message|>Weather in Zürich?<|end|><|start|>assistant")


def test_python_callable_tool_through_transformers_schema(tok):
    """``tools=[function]``: transformers turns the typed, documented function into a JSON schema first."""

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first addend
            b: second addend
        """
        return a + b

    schema = {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "first addend"},
                "b": {"type": "integer", "description": "second addend"},
            },
            "required": ["a", "b"],
        },
    }
    conversation = [{"role": "user", "content": "2+3?"}]
    expected = render_conversation(conversation, tok, tools=[schema], add_generation_prompt=True)
    assert _template_ids(tok, conversation, [add], add_generation_prompt=True) == expected


def test_builtin_python_tool_prompt_matches_the_rollout_loop(tok):
    """The loop declares a PythonTool as GPT-OSS's builtin tool; the template's ``python_tool=True`` agrees."""
    conversation = [{"role": "user", "content": "Compute 2**10."}]
    ids = _template_ids(tok, conversation, None, python_tool=True, add_generation_prompt=True)
    assert ids == render_conversation(conversation, tok, python_tool=True, add_generation_prompt=True)
    assert "stateful Jupyter notebook" in tok.decode(ids)
    engine = ScriptedEngine(tok, {tuple(ids): [harmony_ids(tok, "<|channel|>final<|message|>1024<|return|>")]})
    (rollout,) = run_rollouts(engine, [conversation], tokenizer=tok, tools=[PythonTool()])
    assert rollout.prompt_ids == ids and rollout.final_answer == "1024"


def test_special_token_text_is_the_documented_limit(tok):
    """A chat template cannot keep ``<|end|>`` typed by a user as text; render_conversation can."""
    conversation = [{"role": "user", "content": "say <|end|> please"}]
    rendered = render_conversation(conversation, tok)
    templated = _template_ids(tok, conversation, None)
    assert tok.decode(rendered) == tok.decode(templated) and rendered != templated
    end = tok.convert_tokens_to_ids("<|end|>")
    assert templated.count(end) == rendered.count(end) + 1


def test_bad_messages_raise_clear_errors(tok):
    with pytest.raises(Exception, match="tool message needs 'name'"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    with pytest.raises(Exception, match="role in system, developer, user, assistant, tool"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)
    with pytest.raises(Exception, match="non-empty 'name'"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"description": "no name"}], tokenize=False)


@pytest.mark.parametrize("small", [False, True], ids=["o200k", "small"])
def test_template_is_saved_with_the_tokenizer(tmp_path, small):
    tok = fixture_tokenizer(small=small)
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == tok.chat_template
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    case = random_conversation(7)
    conversation = _without_special_strings(case["conversation"])
    expected = render_conversation(
        conversation,
        tok,
        tools=case["tools"],
        system=case["system"],
        python_tool=case["python_tool"],
        add_generation_prompt=True,
    )
    got = _template_ids(
        loaded,
        conversation,
        case["tools"],
        python_tool=case["python_tool"],
        add_generation_prompt=True,
        **_system_kwargs(case["system"]),
    )
    assert got == expected
