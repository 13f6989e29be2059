"""The parser never raises on garbage, truncated or adversarial token streams, and says what went wrong."""

import random

import pytest

from trl_gptoss.harmony import codec_for, parse_completion, render_conversation
from trl_gptoss.testing.tokenizers import harmony_tokenizer

N_FUZZ = 10_000


@pytest.fixture(scope="module")
def small():
    return harmony_tokenizer(small=True)


def _call_completion(codec):
    text = codec.encode_text
    return (
        text("")
        + [codec.special("<|channel|>")]
        + text("commentary to=functions.calc")
        + text(" ")
        + [codec.special("<|constrain|>")]
        + text("json")
        + [codec.special("<|message|>")]
        + text('{"expr": "2+2"}')
        + [codec.special("<|call|>")]
    )


def _final_completion(codec):
    return (
        [codec.special("<|channel|>")]
        + codec.encode_text("analysis")
        + [codec.special("<|message|>")]
        + codec.encode_text("Think: 2+2=4.")
        + [codec.special("<|end|>"), codec.special("<|start|>")]
        + codec.encode_text("assistant")
        + [codec.special("<|channel|>")]
        + codec.encode_text("final")
        + [codec.special("<|message|>")]
        + codec.encode_text("The answer is 4.")
        + [codec.special("<|return|>")]
    )


def _first_message(codec):
    full = _final_completion(codec)
    return full[: full.index(codec.special("<|end|>")) + 1]


def test_well_formed_completions(small):
    codec = codec_for(small)
    call = parse_completion(_call_completion(codec), small)
    assert call.error is None and not call.truncated
    assert [(c.name, c.parsed_arguments()) for c in call.tool_calls] == [("calc", {"expr": "2+2"})]
    final = parse_completion(_final_completion(codec), small)
    assert final.error is None and final.final_answer == "The answer is 4."
    assert [m.channel for m in final.messages] == ["analysis", "final"] and final.tool_calls == []


def test_every_truncation_is_reported_and_never_yields_a_tool_call(small):
    codec = codec_for(small)
    full = _call_completion(codec)
    for cut in range(len(full)):
        parsed = parse_completion(full[:cut], small)
        assert parsed.tool_calls == [], cut
        if cut:
            assert parsed.truncated and parsed.error.kind == "truncated", cut


@pytest.mark.parametrize(
    "stream,kind",
    [
        (lambda c: c.encode_text(" a b c d") + [c.special("<|message|>"), c.special("<|end|>")], "malformed_header"),
        (
            lambda c: (
                [c.special("<|end|>"), c.special("<|start|>")] + c.encode_text("robot") + [c.special("<|message|>")]
            ),
            "malformed_header",
        ),
        (lambda c: c.encode_text("commentary") + [c.special("<|call|>")], "malformed_header"),
        (lambda c: [c.special("<|channel|>"), c.special("<|message|>"), c.special("<|end|>")], "malformed_header"),
        (lambda c: _first_message(c) + c.encode_text("trailing junk"), "unexpected_token"),
        (lambda c: [c.special("<|message|>")] + c.encode_text("x") + [c.special("<|start|>")], "unterminated_message"),
        (lambda c: [10**9, -1, "x", 3.5] + _final_completion(c), "invalid_token"),
    ],
    ids=[
        "extra-header-words",
        "unknown-role",
        "stop-in-header",
        "empty-channel",
        "text-between-messages",
        "start-in-body",
        "bad-ids",
    ],
)
def test_malformed_streams_give_structured_errors(small, stream, kind):
    parsed = parse_completion(stream(codec_for(small)), small)
    assert parsed.error is not None and parsed.error.kind == kind, parsed.errors
    assert isinstance(parsed.error.position, int) and parsed.error.message


def test_recovers_at_next_start(small):
    codec = codec_for(small)
    junk = [codec.special("<|channel|>"), codec.special("<|message|>"), codec.special("<|end|>")]  # empty channel
    parsed = parse_completion(
        junk
        + codec.encode_text("stray")
        + [codec.special("<|start|>")]
        + codec.encode_text("assistant")
        + _call_completion(codec),
        small,
    )
    assert parsed.error.kind == "malformed_header"
    assert [c.name for c in parsed.tool_calls] == ["calc"]


def test_fuzz_never_raises(small):
    codec = codec_for(small)
    rng = random.Random(1234)
    specials = list(codec.special_ids.values())
    valid = [
        _call_completion(codec),
        _final_completion(codec),
        render_conversation([{"role": "user", "content": "héllo"}], small),
    ]
    for i in range(N_FUZZ):
        mode = i % 4
        if mode == 0:
            stream = [rng.randrange(-5, codec.vocab_size + 5) for _ in range(rng.randrange(0, 40))]
        elif mode == 1:
            stream = [
                rng.choice(specials) if rng.random() < 0.4 else rng.randrange(codec.vocab_size)
                for _ in range(rng.randrange(0, 40))
            ]
        elif mode == 2:
            base = rng.choice(valid)
            stream = base[: rng.randrange(len(base) + 1)]
        else:
            stream = list(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                stream[rng.randrange(len(stream))] = rng.choice(specials + [rng.randrange(codec.vocab_size)])
        parsed = parse_completion(stream, small, role=rng.choice(["assistant", None]))
        assert parsed.error is None or parsed.error in parsed.errors
        assert len(parsed.spans) == len(parsed.messages)


def test_parse_completion_accepts_tensors(small):
    import torch

    ids = torch.tensor(_final_completion(codec_for(small)))
    assert parse_completion(ids, small).final_answer == "The answer is 4."


def test_bad_arguments_raise(small):
    with pytest.raises(ValueError, match="role must be one of"):
        parse_completion([], small, role="robot")
    with pytest.raises(ValueError, match="not valid JSON"):
        codec = codec_for(small)
        stream = _call_completion(codec)
        stream[-2:-1] = codec.encode_text("{oops")
        parse_completion(stream, small).tool_calls[0].parsed_arguments()
