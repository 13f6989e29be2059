"""Cross-check against openai-harmony 0.0.8 (offline vocabulary): identical token ids and parsed messages."""

import pytest

from tests.harmony.corpus import random_conversation, reference_messages, to_harmony_messages
from trl_gptoss.harmony import codec_for, parse_completion, render_conversation
from trl_gptoss.testing.tokenizers import harmony_tokenizer, use_offline_harmony_vocab

N_CONVERSATIONS = 60


@pytest.fixture(scope="module")
def oh():
    use_offline_harmony_vocab()
    import openai_harmony

    return openai_harmony


@pytest.fixture(scope="module")
def encoding(oh):
    return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="module")
def tokenizer():
    return harmony_tokenizer()


def _render_kwargs(case):
    return {k: case[k] for k in ("tools", "system", "python_tool")}


def _as_tuple(oh_message):
    text = "".join(c.text for c in oh_message.content)
    return (
        oh_message.author.role.value,
        oh_message.author.name,
        oh_message.recipient,
        oh_message.channel,
        oh_message.content_type,
        text,
    )


def _mine_as_tuple(message):
    name = message.name if message.role == "tool" else None
    return (message.role, name, message.recipient, message.channel, message.content_type, message.text)


def test_special_token_ids_match_harmony(encoding, tokenizer):
    codec = codec_for(tokenizer)
    assert sorted(codec.stop_ids) == sorted(encoding.stop_tokens())
    for name, token_id in codec.special_ids.items():
        assert encoding.encode(name, allowed_special="all") == [token_id], name


@pytest.mark.parametrize(
    "text",
    ["hello world", "  spaces  ", "naïve 東京 😀", "x=1;\n\ty = [1,2]\r\n", "<|end|>", "12345678901", "don't STOP", ""],
)
def test_ordinary_text_encoding_matches_tiktoken(encoding, tokenizer, text):
    assert codec_for(tokenizer).encode_text(text) == encoding.encode(text, disallowed_special=())


def test_corpus_renders_identically(oh, encoding, tokenizer):
    checked = 0
    for seed in range(N_CONVERSATIONS):
        case = random_conversation(seed)
        convo = oh.Conversation.from_messages(to_harmony_messages(oh, reference_messages(case)))
        for drop in (True, False):
            config = oh.RenderConversationConfig(auto_drop_analysis=drop)
            expected = encoding.render_conversation(convo, config)
            mine = render_conversation(case["conversation"], tokenizer, drop_analysis=drop, **_render_kwargs(case))
            assert mine == expected, (
                f"seed {seed} drop={drop}:\n{encoding.decode_utf8(expected)!r}\n{tokenizer.decode(mine)!r}"
            )
            checked += 1
        expected = encoding.render_conversation_for_training(convo)
        assert (
            render_conversation(case["conversation"], tokenizer, for_training=True, **_render_kwargs(case)) == expected
        ), f"seed {seed} for_training"
    assert checked == 2 * N_CONVERSATIONS


def test_generation_prompt_matches(oh, encoding, tokenizer):
    case = random_conversation(3)
    convo = oh.Conversation.from_messages(to_harmony_messages(oh, reference_messages(case)))
    expected = encoding.render_conversation_for_completion(convo, oh.Role.ASSISTANT)
    assert (
        render_conversation(case["conversation"], tokenizer, add_generation_prompt=True, **_render_kwargs(case))
        == expected
    )


def test_corpus_parses_identically(oh, encoding, tokenizer):
    for seed in range(N_CONVERSATIONS):
        case = random_conversation(seed)
        ids = render_conversation(case["conversation"], tokenizer, drop_analysis=False, **_render_kwargs(case))
        expected = [_as_tuple(m) for m in encoding.parse_messages_from_completion_tokens(ids, role=None)]
        parsed = parse_completion(ids, tokenizer, role=None)
        assert parsed.error is None, f"seed {seed}: {parsed.error}"
        assert [_mine_as_tuple(m) for m in parsed.messages] == expected, f"seed {seed}"


@pytest.mark.parametrize(
    "header",
    [
        "<|channel|>commentary to=functions.get_weather <|constrain|>json",  # recipient after the channel
        " to=functions.get_weather<|channel|>commentary <|constrain|>json",  # recipient before the channel
        " to=functions.get_weather<|channel|>commentary json",  # HF template form, no <|constrain|>
        "<|channel|>analysis to=python code",  # builtin python tool
        "<|channel|>final",
    ],
    ids=["to-after-channel", "to-before-channel", "json-no-constrain", "python", "final"],
)
def test_both_header_orders_parse_like_harmony(oh, encoding, tokenizer, header):
    ids = encoding.encode(header + '<|message|>{"location": "東京"}<|call|>', allowed_special="all")
    expected = [_as_tuple(m) for m in encoding.parse_messages_from_completion_tokens(ids, role=oh.Role.ASSISTANT)]
    parsed = parse_completion(ids, tokenizer)
    assert [_mine_as_tuple(m) for m in parsed.messages] == expected
    if "to=" in header:
        call = parsed.tool_calls[0]
        assert call.arguments == '{"location": "東京"}'
        assert call.parsed_arguments() == {"location": "東京"}
        assert (call.namespace, call.name) == (
            ("functions", "get_weather") if "functions" in header else (None, "python")
        )


def test_multi_message_completion(oh, encoding, tokenizer):
    text = (
        "<|channel|>analysis<|message|>Need the tool.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{"x": 2}<|call|>'
    )
    ids = encoding.encode(text, allowed_special="all")
    parsed = parse_completion(ids, tokenizer)
    expected = encoding.parse_messages_from_completion_tokens(ids, role=oh.Role.ASSISTANT)
    assert [_mine_as_tuple(m) for m in parsed.messages] == [_as_tuple(m) for m in expected]
    assert [c.name for c in parsed.tool_calls] == ["calc"]
    assert parsed.stop_token == codec_for(tokenizer).special("<|call|>") and parsed.error is None
    (start0, end0), (start1, end1) = parsed.spans
    assert start0 == 0 and end0 == start1 and end1 == len(ids)
    assert ids[end0 - 1] == codec_for(tokenizer).special("<|end|>") and ids[start1] == codec_for(tokenizer).special(
        "<|start|>"
    )


# Unicode whitespace that is not ASCII whitespace to Rust (NBSP, line/paragraph separators, ideographic and thin
# spaces, NEL, VT), and U+001C..U+001F, which Python's isspace counts and Rust's White_Space does not.
_ODD_SPACES = {
    "nbsp": "\u00a0",
    "line-sep": "\u2028",
    "para-sep": "\u2029",
    "ideographic": "\u3000",
    "thin": "\u2009",
    "narrow-nbsp": "\u202f",
    "nel": "\x85",
    "vt": "\x0b",
    "file-sep": "\x1c",
    "unit-sep": "\x1f",
    "form-feed": "\x0c",
    "zero-width": "\u200b",
}
_HEADERS_AROUND = [
    "<|channel|>analysis to=python{ws}code",
    " to=python{ws}code<|channel|>analysis",
    "<|channel|>commentary{ws}to=functions.f json",
    "<|channel|>commentary to=functions.f{ws}<|constrain|>json",
    "{ws}to=functions.f<|channel|>commentary json",
    "<|channel|>commentary to={ws}functions.f json",
]


@pytest.mark.parametrize("ws", list(_ODD_SPACES.values()), ids=list(_ODD_SPACES))
def test_header_whitespace_splits_like_harmony(oh, encoding, tokenizer, ws):
    """Recipients split on ASCII whitespace only: ``to=python\\u00a0code`` names no tool there, nor here."""
    for form in _HEADERS_AROUND:
        header = form.format(ws=ws)
        ids = encoding.encode(header + "<|message|>print(1)<|call|>", allowed_special="all")
        try:
            expected = [
                _as_tuple(m) for m in encoding.parse_messages_from_completion_tokens(ids, role=oh.Role.ASSISTANT)
            ]
        except Exception:  # the reference refuses the header: so must we
            expected = None
        parsed = parse_completion(ids, tokenizer)
        mine = [_mine_as_tuple(m) for m in parsed.messages] if parsed.error is None else None
        assert mine == expected, f"{header!r}: reference {expected}, parsed {mine} ({parsed.error})"
        if expected and expected[0][2] != "python":
            assert all(call.recipient != "python" for call in parsed.tool_calls), header
