"""What a vLLM server answers, checked before anything trusts it: schema and value ranges.

A server that answers with the wrong types (a ``null`` list, a string where a token id belongs), with values out of
range (token ids outside ``[0, vocab)``, NaN or positive log-probs, a context length below 2) or with more or fewer
choices than prompts would otherwise crash the trainer far from the cause (an ``IndexError`` in the forward, a
device-side assert on a GPU) or train on garbage. Each check raises ``MalformedAnswer`` naming the field; the engine
turns it into a ``VLLMServerError`` naming the URL too. Token ids are read from ``"token_id:N"`` with ASCII
digits only.
"""

from __future__ import annotations

import math

from trl_gptoss.rollout.types import Generation


class VLLMServerError(RuntimeError):
    """The vLLM server at ``base_url`` did not answer (after retries) or answered with an error."""


FINISH_REASONS = ("stop", "length")


class MalformedAnswer(ValueError):
    """An answer that breaks the schema or a value range at ``field``."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field {field}: {problem}")
        self.field = field


def _get(mapping, key: str, field: str):
    if not isinstance(mapping, dict):
        raise MalformedAnswer(field, f"expected an object, got {_shown(mapping)}")
    if key not in mapping:
        raise MalformedAnswer(f"{field}.{key}", "missing")
    return mapping[key]


def _list(value, field: str) -> list:
    if not isinstance(value, list):
        raise MalformedAnswer(field, f"expected a list, got {_shown(value)}")
    return value


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_id(value, field: str, vocab_size: int | None) -> int:
    """A token id in ``[0, vocab_size)`` (``vocab_size`` ``None``: any id >= 0), from an int or ``"token_id:N"``."""
    if isinstance(value, str):
        prefix, sep, digits = value.partition(":")
        if prefix != "token_id" or not sep or not (digits.isascii() and digits.isdigit()):
            raise MalformedAnswer(field, f"expected 'token_id:N' with N in ASCII digits, got {_shown(value)}")
        value = int(digits)
    if not _is_int(value) or value < 0 or (vocab_size is not None and value >= vocab_size):
        limit = "" if vocab_size is None else f", < the vocabulary size {vocab_size}"
        raise MalformedAnswer(field, f"expected a token id >= 0{limit}, got {_shown(value)}")
    return value


def logprob(value, field: str) -> float:
    """A finite log-probability <= 0."""
    if _is_int(value) or isinstance(value, float):
        value = float(value)
        if math.isfinite(value) and value <= 0.0:
            return value
    raise MalformedAnswer(field, f"expected a finite log-probability <= 0, got {_shown(value)}")


def served_models(answer) -> list[dict]:
    """``GET /v1/models``: ``data``, a non-empty list of ``{"id": str, "max_model_len": int >= 2}``."""
    entries = _list(_get(answer, "data", "answer"), "data")
    if not entries:
        raise MalformedAnswer("data", "no model is served")
    for index, entry in enumerate(entries):
        name = _get(entry, "id", f"data[{index}]")
        if not isinstance(name, str) or not name:
            raise MalformedAnswer(f"data[{index}].id", f"expected a model name, got {_shown(name)}")
        length = _get(entry, "max_model_len", f"data[{index}]")
        if not _is_int(length) or length < 2:
            raise MalformedAnswer(f"data[{index}].max_model_len", f"expected an integer >= 2, got {_shown(length)}")
    return entries


def only_choice(answer) -> dict:
    """The one choice of a completions answer to one prompt (``n: 1``)."""
    choices = _list(_get(answer, "choices", "answer"), "choices")
    if len(choices) != 1:
        raise MalformedAnswer("choices", f"expected one choice per prompt, got {len(choices)}")
    if not isinstance(choices[0], dict):
        raise MalformedAnswer("choices[0]", f"expected an object, got {_shown(choices[0])}")
    return choices[0]


def generation(choice, *, vocab_size: int | None = None, max_tokens: int | None = None, field="choices[0]"):
    """A ``Generation`` from one completions choice: ids from ``logprobs.tokens`` (and ``token_ids`` when sent,
    which must agree), one finite log-prob <= 0 per token, ``finish_reason`` stop or length, at most
    ``max_tokens`` tokens."""
    logprobs = _get(choice, "logprobs", field)
    tokens = _list(_get(logprobs, "tokens", f"{field}.logprobs"), f"{field}.logprobs.tokens")
    values = _list(_get(logprobs, "token_logprobs", f"{field}.logprobs"), f"{field}.logprobs.token_logprobs")
    ids = [token_id(t, f"{field}.logprobs.tokens[{i}]", vocab_size) for i, t in enumerate(tokens)]
    if len(values) != len(ids):
        raise MalformedAnswer(f"{field}.logprobs.token_logprobs", f"{len(values)} log-probs for {len(ids)} tokens")
    sent = choice.get("token_ids")
    if sent is not None:
        sent = [token_id(t, f"{field}.token_ids[{i}]", vocab_size) for i, t in enumerate(_list(sent, "token_ids"))]
        if sent != ids:
            raise MalformedAnswer(f"{field}.token_ids", f"{sent[:8]} disagree with logprobs.tokens {ids[:8]}")
    if max_tokens is not None and len(ids) > max_tokens:
        raise MalformedAnswer(f"{field}.logprobs.tokens", f"{len(ids)} tokens, more than max_tokens={max_tokens}")
    finish = _get(choice, "finish_reason", field)
    if finish not in FINISH_REASONS:
        raise MalformedAnswer(f"{field}.finish_reason", f"expected 'stop' or 'length', got {_shown(finish)}")
    lps = [logprob(v, f"{field}.logprobs.token_logprobs[{i}]") for i, v in enumerate(values)]
    return Generation(ids, lps, finish)


def prompt_logprobs(answer, token_ids: list[int]) -> list[float]:
    """``prompt_logprobs`` of a scoring answer: the log-prob of each of ``token_ids[1:]`` given the ones before it
    (entries keyed ``"N"`` or ``"token_id:N"``)."""
    entries = _list(_get(only_choice(answer), "prompt_logprobs", "choices[0]"), "choices[0].prompt_logprobs")
    if len(entries) != len(token_ids):
        raise MalformedAnswer("choices[0].prompt_logprobs", f"{len(entries)} entries for {len(token_ids)} tokens")
    values = []
    for index, (token, entry) in enumerate(zip(token_ids[1:], entries[1:]), start=1):
        field = f"choices[0].prompt_logprobs[{index}]"
        if not isinstance(entry, dict):
            raise MalformedAnswer(field, f"expected an object, got {_shown(entry)}")
        found = [v for k, v in entry.items() if k in (str(token), f"token_id:{token}")]
        if len(found) != 1 or not isinstance(found[0], dict) or "logprob" not in found[0]:
            raise MalformedAnswer(field, f"no log-prob for token {token}: {_shown(entry)}")
        values.append(logprob(found[0]["logprob"], f"{field}.logprob"))
    return values


def rpc_results(answer) -> list:
    """``/collective_rpc``: ``results``, one per worker (at least one)."""
    results = _list(_get(answer, "results", "answer"), "results")
    if not results:
        raise MalformedAnswer("results", "no worker answered")
    return results
