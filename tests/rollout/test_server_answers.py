"""Answers a broken vLLM server sends are checked before anything trusts them: each wrong type or value out of
range is a ``VLLMServerError`` naming the URL and the field, retried where the call changes nothing."""

import asyncio
import json

import pytest

from tests.rollout.hostile_server import HostileServer, answer
from trl_gptoss.rollout.types import GenerationRequest
from trl_gptoss.rollout.vllm_engine import VLLMServerEngine, VLLMServerError

VOCAB = 100


def _models(max_model_len=64):
    return json.dumps({"data": [{"id": "m", "max_model_len": max_model_len}]}).encode()


def _choice(**changes):
    choice = {
        "finish_reason": "length",
        "token_ids": [9, 8],
        "logprobs": {"tokens": ["token_id:9", "token_id:8"], "token_logprobs": [-0.5, -0.25]},
    }
    for key, value in changes.items():
        if key.startswith("logprobs."):
            choice["logprobs"][key.split(".", 1)[1]] = value
        elif value is _DROP:
            del choice[key]
        else:
            choice[key] = value
    return choice


_DROP = object()
_three_tokens = {"logprobs.tokens": [f"token_id:{i}" for i in (1, 2, 3)], "logprobs.token_logprobs": [-1, -1, -1]}
GOOD = {"choices": [_choice()]}

COMPLETIONS = {
    "list-body": ([GOOD], "field answer: expected an object"),
    "empty-200-body": (None, "field answer: expected an object, got None"),
    "null-choices": ({"choices": None}, "field choices: expected a list"),
    "two-choices": ({"choices": [_choice(), _choice()]}, "expected one choice per prompt, got 2"),
    "no-choice": ({"choices": []}, "expected one choice per prompt, got 0"),
    "null-logprobs": ({"choices": [_choice(logprobs=None)]}, "field choices[0].logprobs: expected an object, got None"),
    "string-token": ({"choices": [_choice(**{"logprobs.tokens": ["hello", "token_id:8"]})]}, "tokens[0]"),
    "latin1-digit-token": ({"choices": [_choice(**{"logprobs.tokens": ["token_id:\u00b2", "token_id:8"]})]}, "ASCII"),
    "negative-token": ({"choices": [_choice(**{"logprobs.tokens": ["token_id:-1", "token_id:8"]})]}, "tokens[0]"),
    "token-past-vocab": (
        {"choices": [_choice(token_ids=[9, VOCAB], **{"logprobs.tokens": ["token_id:9", f"token_id:{VOCAB}"]})]},
        f"< the vocabulary size {VOCAB}",
    ),
    "ids-disagree": ({"choices": [_choice(token_ids=[9, 7])]}, "field choices[0].token_ids"),
    "no-finish-reason": ({"choices": [_choice(finish_reason=_DROP)]}, "choices[0].finish_reason: missing"),
    "odd-finish-reason": ({"choices": [_choice(finish_reason="abort")]}, "expected 'stop' or 'length'"),
    "nan-logprob": ({"choices": [_choice(**{"logprobs.token_logprobs": [float("nan"), -0.1]})]}, "token_logprobs[0]"),
    "positive-logprob": ({"choices": [_choice(**{"logprobs.token_logprobs": [-0.1, 0.5]})]}, "token_logprobs[1]"),
    "string-logprob": ({"choices": [_choice(**{"logprobs.token_logprobs": ["-0.1", -0.1]})]}, "token_logprobs[0]"),
    "missing-logprob": ({"choices": [_choice(**{"logprobs.token_logprobs": [-0.1]})]}, "1 log-probs for 2 tokens"),
    "too-many-tokens": (
        {"choices": [_choice(token_ids=[1, 2, 3], **_three_tokens)]},
        "more than max_tokens=2",
    ),
}


def _server(completion):
    def script(number, head):
        if head.startswith(b"GET"):
            yield answer(_models())
        else:
            yield answer(b"" if completion is None else json.dumps(completion).encode())

    return HostileServer(script)


@pytest.mark.parametrize("path", ["async", "blocking"])
@pytest.mark.parametrize("case", COMPLETIONS)
def test_a_malformed_completion_names_the_url_and_field_and_is_retried(case, path):
    completion, match = COMPLETIONS[case]
    with _server(completion) as server:
        engine = VLLMServerEngine(server.url, max_retries=1, backoff=0.01, vocab_size=VOCAB)
        request = GenerationRequest([1, 2], 2)
        with pytest.raises(VLLMServerError) as info:
            asyncio.run(engine.generate(request)) if path == "async" else engine.generate_sync(request)
        engine.close()
        posts = [r for r in server.requests if r.startswith("POST")]
    message = str(info.value)
    assert f"{server.url}/v1/completions failed after 2 attempt(s): malformed answer: field " in message, message
    assert match in message, message
    assert len(posts) == 2, "a completion changes nothing on the server: a malformed one is asked for again"


def test_a_good_completion_passes_the_checks():
    with _server(GOOD) as server:
        engine = VLLMServerEngine(server.url, vocab_size=VOCAB)
        generation = asyncio.run(engine.generate(GenerationRequest([1, 2], 2)))
        engine.close()
    assert (generation.token_ids, generation.logprobs, generation.finish_reason) == ([9, 8], [-0.5, -0.25], "length")


@pytest.mark.parametrize(
    "models, match",
    [
        (_models(0), "data[0].max_model_len: expected an integer >= 2, got 0"),
        (_models(-7), "got -7"),
        (_models(True), "got True"),
        (_models("64"), "got '64'"),
        (b'{"data": []}', "no model is served"),
        (b'{"data": null}', "field data: expected a list"),
        (b'[{"id": "m"}]', "field answer: expected an object"),
        (b'{"data": [{"max_model_len": 64}]}', "data[0].id: missing"),
    ],
    ids=["zero", "negative", "bool", "string", "none-served", "null-data", "list-body", "no-id"],
)
def test_a_malformed_model_list_names_the_url_and_field(models, match):
    with HostileServer(lambda number, head: [answer(models)]) as server, pytest.raises(VLLMServerError) as info:
        VLLMServerEngine(server.url, max_retries=1, backoff=0.01)
    assert f"{server.url}/v1/models failed after 2 attempt(s): malformed answer: " in str(info.value)
    assert match in str(info.value)


def _scoring(entries):
    return {"choices": [{"finish_reason": "length", "prompt_logprobs": entries, "logprobs": None}]}


@pytest.mark.parametrize(
    "entries, match",
    [
        ([None, {"token_id:5": {"logprob": 0.5}}, {"6": {"logprob": -1}}], "prompt_logprobs[1].logprob"),
        ([None, {"token_id:5": {"logprob": float("-inf")}}, {"6": {"logprob": -1}}], "finite"),
        ([None, {"token_id:4": {"logprob": -1}}, {"6": {"logprob": -1}}], "no log-prob for token 5"),
        ([None, {"5": {"logprob": -1}}], "2 entries for 3 tokens"),
    ],
    ids=["positive", "minus-infinity", "other-token", "short"],
)
def test_malformed_scores_name_the_url_and_field(entries, match):
    def script(number, head):
        yield answer(_models() if head.startswith(b"GET") else json.dumps(_scoring(entries)).encode())

    with HostileServer(script) as server:
        engine = VLLMServerEngine(server.url, max_retries=0)
        with pytest.raises(VLLMServerError, match=f"{server.url}/v1/completions failed") as info:
            engine.score([4, 5, 6])
        engine.close()
    assert match in str(info.value)


def test_a_collective_rpc_answer_without_results_names_the_field():
    from trl_gptoss.rollout.weights.server_calls import collective_rpc

    def script(number, head):
        yield answer(_models() if head.startswith(b"GET") else b'{"results": null}')

    with HostileServer(script) as server:
        engine = VLLMServerEngine(server.url, max_retries=0)
        with pytest.raises(VLLMServerError, match=f"{server.url}/collective_rpc .*field results: expected a list"):
            collective_rpc(engine, "gptoss_checkpoint_layout")
        engine.close()
