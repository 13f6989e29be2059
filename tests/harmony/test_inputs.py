"""Inputs to the Harmony layer: what ``parse_completion`` and ``render_conversation`` accept, and the clear
errors for what they refuse (a programming error is an exception; a bad token stream never is)."""

import numpy as np
import pytest
import torch

from trl_gptoss.harmony import Message, codec_for, parse_completion, render_conversation
from trl_gptoss.testing.tokenizers import harmony_tokenizer


@pytest.fixture(scope="module")
def small():
    return harmony_tokenizer(small=True)


@pytest.fixture(scope="module")
def final_ids(small):
    codec = codec_for(small)
    return (
        [codec.special("<|channel|>")]
        + codec.encode_text("final")
        + [codec.special("<|message|>")]
        + codec.encode_text("The answer is 4.")
        + [codec.special("<|return|>")]
    )


@pytest.mark.parametrize(
    "convert",
    [
        list,
        lambda ids: [np.int64(i) for i in ids],
        lambda ids: [np.uint32(i) for i in ids],
        lambda ids: np.asarray(ids, dtype=np.int32),
        lambda ids: torch.tensor(ids),
        lambda ids: torch.tensor(ids, dtype=torch.int32),
        lambda ids: list(torch.tensor(ids)),  # 0-d tensors
        tuple,
    ],
    ids=[
        "list",
        "numpy-int64-items",
        "numpy-uint32-items",
        "numpy-array",
        "tensor",
        "int32-tensor",
        "0d-tensor-items",
        "tuple",
    ],
)
def test_any_integer_sequence_parses_alike(small, final_ids, convert):
    parsed = parse_completion(convert(final_ids), small)
    assert parsed.error is None and parsed.final_answer == "The answer is 4."


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (None, TypeError, "got NoneType"),
        ("<|start|>assistant", TypeError, "got str"),
        (42, TypeError, "got int"),
        (torch.zeros(2, 5, dtype=torch.long), ValueError, r"1-D, got shape \(2, 5\)"),
        (np.zeros((1, 3), dtype=np.int64), ValueError, r"1-D, got shape \(1, 3\)"),
        (torch.tensor(7), ValueError, r"1-D, got shape \(\)"),
        ([[1, 2], [3]], ValueError, "holds sequences"),
        (torch.tensor([1.0, 2.0]), TypeError, "dtype torch.float32"),
        (np.array([True, False]), TypeError, "dtype bool"),
    ],
    ids=["none", "str", "int", "2d-tensor", "2d-array", "0d-tensor", "list-of-lists", "float-tensor", "bool-array"],
)
def test_non_sequences_are_programming_errors_that_say_what_to_pass(small, bad, error, message):
    with pytest.raises(error, match=message):
        parse_completion(bad, small)


def test_bad_elements_inside_a_sequence_are_parse_errors_not_exceptions(small, final_ids):
    parsed = parse_completion([True, np.bool_(True), torch.tensor(1.5), None] + final_ids, small)
    assert [e.kind for e in parsed.errors[:4]] == ["invalid_token"] * 4
    assert parsed.final_answer == "The answer is 4."


@pytest.mark.parametrize(
    "conversation, message",
    [
        (
            [{"role": "user", "content": "hi"}, {"role": "user", "content": 0}],
            r"conversation\[1\]: field 'content'.*int 0",
        ),
        ([{"role": "user", "content": []}], r"conversation\[0\]: field 'content'.*list \[\].*join the text parts"),
        ([{"role": "user", "content": False}], r"conversation\[0\]: field 'content'.*bool False"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": 0}],
            r"conversation\[1\]: field 'content'",
        ),
        ([{"role": "assistant", "content": "a", "thinking": 0}], r"conversation\[0\]: field 'thinking'"),
        ([{"role": "assistant", "content": "a", "tool_calls": {}}], r"conversation\[0\]: field 'tool_calls'"),
        ([{"role": "assistant", "content": "a", "channel": 1}], r"conversation\[0\]: field 'channel'"),
        ([{"role": "tool", "name": "f", "content": 0}], r"conversation\[0\]: field 'content'"),
        ([{"role": "user", "content": "q"}, {"role": "system", "content": 0}], r"conversation\[1\]: field 'content'"),
        ([{"role": "user", "content": "q"}, "hello"], r"conversation\[1\]: each message must be a dict"),
        ([Message("user", "q"), {"role": "robot"}], r"conversation\[1\]"),
        ("hello", "a conversation is a list"),
    ],
    ids=[
        "zero",
        "empty-list",
        "false",
        "assistant-zero",
        "thinking",
        "tool-calls",
        "channel",
        "tool-zero",
        "system-zero",
        "str-item",
        "bad-role",
        "str-conversation",
    ],
)
def test_render_refuses_falsy_non_strings_naming_index_and_field(small, conversation, message):
    with pytest.raises(ValueError, match=message):
        render_conversation(conversation, small)


def test_none_and_missing_content_are_still_empty(small):
    with_none = render_conversation([{"role": "user", "content": None}], small)
    assert (
        with_none
        == render_conversation([{"role": "user"}], small)
        == render_conversation([{"role": "user", "content": ""}], small)
    )


def test_message_refuses_non_text_content():
    with pytest.raises(ValueError, match="content must be a str"):
        Message("user", 0)
    with pytest.raises(ValueError, match="channel must be a str or None"):
        Message("assistant", "x", channel=0)
