"""Rollout routes (R3): the answer checks, the merge over turns, the prefix fill, the worker's store, the server."""

import asyncio
import base64

import numpy as np
import pytest
import torch
from transformers import GptOssForCausalLM

from trl_gptoss.experts.routing import record_routing
from trl_gptoss.rollout import GenerationRequest, VLLMServerEngine
from trl_gptoss.rollout.routes import (
    MISSING,
    RouteShape,
    TrajectoryRoutes,
    missing_counts,
    parse_routes,
    route_tag,
    token_digest,
)
from trl_gptoss.rollout.vllm_worker.gptoss_vllm_routes import RouteStore, _token_digest, dense_routes, take_answer

SHAPE = RouteShape(layers=2, top_k=2, num_experts=4)


def _ids(positions: int) -> list[int]:
    """The token ids of a request of ``positions`` tokens."""
    return list(range(100, 100 + positions))


def _answer(table: np.ndarray, token_ids=None) -> dict:
    token_ids = _ids(table.shape[0]) if token_ids is None else token_ids
    return {
        "shape": list(table.shape),
        "b64": base64.b64encode(table.astype(np.int16).tobytes()).decode(),
        "tokens_digest": token_digest(token_ids[: table.shape[0]]),
    }


def _table(positions: int, fill: int | None = None, seed: int = 0) -> np.ndarray:
    """Distinct experts in every row (as top-k chooses them), or ``fill`` everywhere."""
    if fill is not None:
        return np.full((positions, SHAPE.layers, SHAPE.top_k), fill, dtype=np.int16)
    rng = np.random.default_rng(seed)
    rows = [rng.permutation(SHAPE.num_experts)[: SHAPE.top_k] for _ in range(positions * SHAPE.layers)]
    return np.array(rows, dtype=np.int16).reshape(positions, SHAPE.layers, SHAPE.top_k)


def test_parse_routes_pads_short_tables_and_refuses_what_would_misalign():
    table, note = parse_routes(_answer(_table(5)), SHAPE, _ids(7))
    assert note is None and table.dtype == torch.int16 and table.shape == (7, 2, 2)
    assert torch.equal(table[:5], torch.from_numpy(_table(5)).to(torch.int16)) and (table[5:] == MISSING).all()
    refused = {
        "no routes": (None, "captured no routes"),
        "preempted": ({"recomputed": True}, "preempted"),
        "retried": ({"ambiguous": True}, "two requests"),
        "too long": (_answer(_table(9)), "routes for 9 positions, the request has 7"),
        "other layers": (_answer(np.zeros((7, 3, 2))), "do not fit [positions, 2, 2]"),
        "other top-k": (_answer(np.zeros((7, 2, 4))), "do not fit"),
        "expert id out of range": (_answer(_table(7, fill=4)), "outside [0, 4)"),
        "below -1": (_answer(_table(7, fill=-2)), "outside"),
        "not base64": ({"shape": [7, 2, 2], "b64": "***"}, "malformed"),
        "bytes for another shape": ({"shape": [7, 2, 2], "b64": base64.b64encode(b"\0" * 6).decode()}, "values"),
        "no shape": ({"b64": ""}, "not three non-negative integers"),
        "a list": ([1, 2], "not an object"),
    }
    for case, (answer, reason) in refused.items():
        table, note = parse_routes(answer, SHAPE, _ids(7))
        assert table is None and reason in note, (case, note)


def _with(answer: dict, **changes) -> dict:
    return {**answer, **changes}


def test_parse_routes_refuses_duplicate_experts_odd_dims_and_the_routes_of_other_tokens():
    """A right-shaped table is replayed only when every row names top-k distinct experts, its header holds plain
    non-negative integers, and its digest is that of this request's token ids."""
    twice = _table(7)
    twice[3, 1] = [2, 2]
    partly = _table(7)
    partly[2, 0] = [1, MISSING]
    good = _answer(_table(7))
    other_tokens = _ids(7)
    other_tokens[4] += 1
    refused = {
        "one expert twice": (_answer(twice), "names one expert twice"),
        "a row partly routed": (_answer(partly), "fewer experts than top-k"),
        "dims true": (_with(good, shape=[7, True, 2]), "not three non-negative integers"),
        "dims 2.7": (_with(good, shape=[7, 2.0, 2]), "not three non-negative integers"),
        "dims '2'": (_with(good, shape=[7, "2", 2]), "not three non-negative integers"),
        "negative header": (_with(good, shape=[-(2**63), 2, 2], b64=""), "not three non-negative integers"),
        "no digest": ({k: v for k, v in good.items() if k != "tokens_digest"}, "other tokens"),
        "other tokens": (_answer(_table(7), other_tokens), "other tokens"),
        "another request's shorter prompt": (_answer(_table(5), _ids(6)[1:]), "other tokens"),
    }
    for case, (answer, reason) in refused.items():
        table, note = parse_routes(answer, SHAPE, _ids(7))
        assert table is None and reason in note, (case, note)
    table, note = parse_routes(good, SHAPE, _ids(7))
    assert note is None and table.shape == (7, 2, 2)


def test_worker_and_client_digest_token_ids_alike():
    ids = [0, 1, 200_000, 2**40]
    assert _token_digest(np.array(ids, dtype=np.int64)) == token_digest(ids) == token_digest(np.array(ids))


def test_turns_merge_with_the_first_computation_winning():
    turns = TrajectoryRoutes()
    first = torch.from_numpy(_table(6, seed=1)).to(torch.int16)
    first[4:] = MISSING  # e.g. the last sampled token of turn 1 is never fed back
    second = torch.from_numpy(_table(10, seed=2)).to(torch.int16)
    second[:3] = MISSING  # a prefix-cache hit: turn 2 did not compute the start again
    turns.add_turn(first, None, 1)
    turns.add_turn(second, None, 2)
    turns.add_turn(None, "the request was preempted", 3)
    table = turns.finish(12)
    assert torch.equal(table[:4], first[:4])  # turn 1's routes kept where both computed
    assert torch.equal(table[4:10], second[4:10])  # turn 2 fills what turn 1 lacked
    assert (table[10:] == MISSING).all()
    assert turns.notes == ["turn 3: the request was preempted"]
    assert TrajectoryRoutes().finish(5) is None


def test_missing_counts_counts_every_position_but_the_last():
    routed = torch.from_numpy(_table(6, seed=3)).to(torch.int16)
    partly = routed[:5].clone()
    partly[1:3] = MISSING
    # positions that count: all but each trajectory's last; missing: 2 of 4, and all 2 of the unrouted one
    assert missing_counts([routed, partly, None], [6, 5, 3]) == (4, 11)


def _rows(n, seed):
    return _table(n, seed=seed).astype(np.int16)


KEY = bytes(range(32))  # the client's tag key of these tests
_TAGS: dict[str, str] = {}


def _rid(name: str) -> str:
    """vLLM's id of the completion the client sent as ``name``, tagged to ask for its routes."""
    return f"{_prefix(name)}0-x"


def _prefix(name: str) -> str:
    return f"cmpl-{_TAGS.setdefault(name, route_tag(KEY))}-"


def _store(**kwargs) -> RouteStore:
    store = RouteStore(layers=2, top_k=2, **kwargs)
    store.allow_key(KEY)
    return store


def test_worker_store_fills_prefix_cache_hits_from_blocks_another_request_computed():
    store = _store(block=4)
    tokens = np.arange(100, 113)  # 13 tokens: 3 complete blocks of 4
    first = _rows(13, seed=1)
    store.add(_rid("a"), np.arange(13), tokens, first, prefix=None)
    # another request (another client process) whose first 8 positions the engine served from its cache
    hit = _rows(5, seed=2)
    store.add(_rid("b"), np.arange(8, 13), tokens[8:], hit, prefix=lambda: tokens[:8])
    table_b, note = parse_routes(dense_routes(store.take(_prefix("b"))[0]), SHAPE, list(tokens))
    assert note is None and torch.equal(table_b[:8], torch.from_numpy(first[:8]))
    assert torch.equal(table_b[8:], torch.from_numpy(hit))
    # a request whose cached prefix differs from every stored one in its second block keeps only the first
    other = tokens.copy()
    other[5] = 7
    store.add(_rid("c"), np.arange(8, 10), other[8:10], _rows(2, seed=3), prefix=lambda: other[:8])
    table_c, _ = parse_routes(dense_routes(store.take(_prefix("c"))[0]), SHAPE, list(other[:10]))
    assert torch.equal(table_c[:4], torch.from_numpy(first[:4])) and (table_c[4:8] == MISSING).all()
    assert len(store.take(_prefix("a"))) == 1 and store.take(_prefix("a")) == []
    # a weight push forgets the blocks: a (hypothetical) hit afterwards gets no stale routes
    store.forget_blocks()
    store.add(_rid("d"), np.arange(8, 10), tokens[8:10], _rows(2, seed=4), prefix=lambda: tokens[:8])
    table_d, _ = parse_routes(dense_routes(store.take(_prefix("d"))[0]), SHAPE, list(tokens[:10]))
    assert (table_d[:8] == MISSING).all()
    # a block computed again replaces the earlier computation
    store.add(_rid("e"), np.arange(4), tokens[:4], _rows(4, seed=5), prefix=None)
    store.add(_rid("f"), np.arange(4), tokens[:4], _rows(4, seed=6), prefix=None)
    store.add(_rid("g"), np.arange(4, 5), tokens[4:5], _rows(1, seed=7), prefix=lambda: tokens[:4])
    table_g, _ = parse_routes(dense_routes(store.take(_prefix("g"))[0]), SHAPE, list(tokens[:5]))
    assert torch.equal(table_g[:4], torch.from_numpy(_rows(4, seed=6)))


def test_worker_store_drops_the_oldest_and_reports_recomputed_positions():
    store = _store(block=4, max_bytes=4_000)
    for request in range(5):
        store.add(_rid(str(request)), np.arange(10), np.arange(10), _rows(10, request), prefix=None)
    store.add(_rid("big"), np.arange(100), np.arange(100), _rows(100, 9), prefix=None)  # evicts the oldest
    assert store.take(_prefix("0")) == [] and len(store.take(_prefix("4"))) == 1
    store.add(_rid("p"), np.arange(3), np.arange(3), _rows(3, 1), prefix=None)
    store.add(_rid("p"), np.arange(3, 5), np.arange(3, 5), _rows(2, 2), prefix=None)
    table, note = parse_routes(dense_routes(store.take(_prefix("p"))[0]), SHAPE, list(range(5)))
    assert note is None and torch.equal(table[3:], torch.from_numpy(_rows(2, 2)))
    store.add(_rid("q"), np.arange(3), np.arange(3), _rows(3, 1), prefix=None)
    store.add(_rid("q"), np.arange(3), np.arange(3), _rows(3, 1), prefix=None)  # preempted: computed again
    assert dense_routes(store.take(_prefix("q"))[0]) == {"recomputed": True}


def test_the_store_keeps_only_tagged_requests_and_says_which_it_evicted():
    """Anyone may send a completion (the route is open by design); only the requests a client tagged under a key
    it gave through the authenticated route are stored, so others cannot push a client's routes out. Routes the
    store dropped unread are answered "evicted", which the client reports, instead of nothing."""
    store = _store(block=4, max_bytes=4_000)
    untagged = ["cmpl-0123-0-x", f"cmpl-{'a' * 64}-0-x", f"cmpl-{route_tag(bytes(32))}-0-x"]  # plain, forged, key
    for request_id in untagged:
        store.add(request_id, np.arange(10), np.arange(10), _rows(10, 1), prefix=None)
    assert store.take("") == [], "a completion that did not ask for its routes was stored"
    for request in range(5):
        store.add(_rid(f"e{request}"), np.arange(10), _ids(10), _rows(10, request), prefix=None)
    store.add(_rid("big"), np.arange(100), _ids(100), _rows(100, 9), prefix=None)  # evicts the oldest
    assert take_answer(store, _TAGS["e0"]) == {"evicted": True}
    table, note = parse_routes(take_answer(store, _TAGS["e0"]), SHAPE, _ids(10))  # said once, then forgotten
    assert table is None and note == "the server captured no routes for this request"
    table, note = parse_routes({"evicted": True}, SHAPE, _ids(10))
    assert table is None and "dropped this request's routes before they were taken" in note
    table, note = parse_routes(take_answer(store, _TAGS["e4"]), SHAPE, _ids(10))
    assert note is None and torch.equal(table, torch.from_numpy(_rows(10, 4)))


def test_one_runs_backlog_never_pushes_out_another_runs_routes():
    """Over the bound, the store drops the oldest request of the client (run) holding the most bytes -- not the
    oldest overall, which would be the quieter run's."""
    other_key = bytes(range(1, 33))
    store = _store(block=4, max_bytes=4_000)
    store.allow_key(other_key)
    quiet = route_tag(other_key)
    store.add(f"cmpl-{quiet}-0-x", np.arange(10), _ids(10), _rows(10, 7), prefix=None)  # the oldest request
    for request in range(4):  # the busy run: each request ~1 KiB, the store holds fewer than five
        store.add(_rid(f"busy{request}"), np.arange(10), _ids(10), _rows(10, request), prefix=None)
    table, note = parse_routes(take_answer(store, quiet), SHAPE, _ids(10))
    assert note is None and torch.equal(table, torch.from_numpy(_rows(10, 7))), "the quiet run's routes were dropped"
    assert take_answer(store, _TAGS["busy0"]) == {"evicted": True}
    assert parse_routes(take_answer(store, _TAGS["busy3"]), SHAPE, _ids(10))[1] is None


def _generate(engine, request):
    async def go():
        return await engine.generate(request)

    return asyncio.run(go())


def _cached_tokens(server) -> float:
    """vLLM's count of prompt tokens served from the prefix cache (``vllm:prefix_cache_hits``)."""
    import requests

    lines = requests.get(f"{server.base_url}/metrics", timeout=10).text.splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("vllm:prefix_cache_hits_total"))


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_the_server_reports_the_routes_it_computed_and_those_its_cache_served(vllm_tiny_server, tiny_checkpoint):
    engines = [VLLMServerEngine(vllm_tiny_server.base_url, timeout=120) for _ in range(2)]  # two client processes
    try:
        assert [e.enable_routes() for e in engines] == [SHAPE, SHAPE]
        prompt = [int(t) for t in torch.randint(10, 400, (300,), generator=torch.Generator().manual_seed(0))]
        first = _generate(engines[0], GenerationRequest(prompt, 8, seed=1))
        before = _cached_tokens(vllm_tiny_server)
        later = [
            _generate(engines[1], GenerationRequest(prompt, 8, seed=2)),
            _generate(engines[0], GenerationRequest(prompt, 8, seed=3)),
        ]
        cached = _cached_tokens(vllm_tiny_server) - before
        # a completion that did not ask (anyone may send one) leaves nothing in the store
        from trl_gptoss.rollout.vllm_engine import completion_payload
        from trl_gptoss.rollout.weights.server_calls import collective_rpc

        stranger = {**completion_payload(engines[0].model, GenerationRequest(prompt[:40], 4)), "request_id": "f" * 64}
        engines[0].request("POST", "/v1/completions", stranger)
        assert collective_rpc(engines[0], "gptoss_take_routes", "f" * 64) == [None]
        engines[1].disable_routes()  # capture off: the server answers without routes again
        plain = _generate(engines[1], GenerationRequest(prompt, 4, seed=4))
        assert plain.routes is None and plain.routes_note is None and engines[1].route_shape is None
    finally:
        for engine in engines:
            engine.close()
    model = GptOssForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation="eager")
    ids = prompt + first.token_ids
    with torch.no_grad(), record_routing(model) as record:
        model(input_ids=torch.tensor([ids]))
    trainer_routes = torch.stack([t.long().sort(-1).values for t in record.indices], dim=1)  # [T, layers, k]
    routes = first.routes
    assert routes.shape == (len(ids), 2, 2) and first.routes_note is None
    assert (routes[:-1] != MISSING).all() and (routes[-1] == MISSING).all()  # the last token is never fed back
    same = (routes[:-1].long().sort(-1).values == trainer_routes[:-1]).all(-1).all(-1).float().mean().item()
    assert same >= 0.99, f"the engine's experts agree with a transformers forward on only {same:.1%} of positions"
    # the later requests' prompts came from the prefix cache: their routes are those of the request that computed them
    assert cached >= 2 * 256, f"only {cached} prompt tokens were served from the prefix cache"
    for other in later:
        assert other.routes_note is None and (other.routes[:-1] != MISSING).all()
        assert torch.equal(other.routes[: len(prompt)], routes[: len(prompt)])


def test_capture_refuses_a_forward_it_cannot_see():
    from types import SimpleNamespace

    from trl_gptoss.rollout.vllm_worker.gptoss_vllm_routes import _check_capturable

    eager = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=True))
    runner = SimpleNamespace(_model_forward=None, input_batch=None, query_start_loc=None)
    _check_capturable(runner, eager)
    with pytest.raises(RuntimeError, match="--enforce-eager"):
        _check_capturable(runner, SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False)))
    with pytest.raises(RuntimeError, match=r"has no \['query_start_loc'\].*VLLM_USE_V2_MODEL_RUNNER=0"):
        _check_capturable(SimpleNamespace(_model_forward=None, input_batch=None), eager)
