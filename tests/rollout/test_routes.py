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
    fill_shared_prefixes,
    missing_fraction,
    parse_routes,
)
from trl_gptoss.rollout.vllm_worker.gptoss_vllm_routes import RouteStore, dense_routes

SHAPE = RouteShape(layers=2, top_k=2, num_experts=4)


def _answer(table: np.ndarray) -> dict:
    return {"shape": list(table.shape), "b64": base64.b64encode(table.astype(np.int16).tobytes()).decode()}


def _table(positions: int, fill: int | None = None, seed: int = 0) -> np.ndarray:
    if fill is not None:
        return np.full((positions, SHAPE.layers, SHAPE.top_k), fill, dtype=np.int16)
    return np.random.default_rng(seed).integers(0, SHAPE.num_experts, (positions, SHAPE.layers, SHAPE.top_k))


def test_parse_routes_pads_short_tables_and_refuses_what_would_misalign():
    table, note = parse_routes(_answer(_table(5)), SHAPE, positions=7)
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
        "no shape": ({"b64": ""}, "malformed"),
        "a list": ([1, 2], "not an object"),
    }
    for case, (answer, reason) in refused.items():
        table, note = parse_routes(answer, SHAPE, positions=7)
        assert table is None and reason in note, (case, note)


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


def test_prefix_fill_copies_only_from_identical_prefixes():
    shared = [7, 8, 9, 10]
    a, b, c = shared + [1, 2], shared + [3], [7, 8, 0, 10, 1]
    table_a = torch.from_numpy(_table(6, seed=3)).to(torch.int16)
    table_b = torch.full((5, 2, 2), MISSING, dtype=torch.int16)
    table_b[4] = 1
    table_c = torch.full((5, 2, 2), MISSING, dtype=torch.int16)
    fill_shared_prefixes([a, b, c], [table_a, table_b, table_c])
    assert torch.equal(table_b[:4], table_a[:4]) and (table_b[4] == 1).all()
    assert torch.equal(table_c[:2], table_a[:2])  # [7, 8] is shared
    assert (table_c[2:] == MISSING).all()  # diverged at position 2, even where later tokens agree
    # positions that count: all but each trajectory's last; missing: c's 2 of 4, all 2 of the unrouted one
    assert missing_fraction([table_a, table_b, table_c, None], [6, 5, 5, 3]) == pytest.approx(4 / 15)


def test_worker_store_drops_the_oldest_and_reports_recomputed_positions():
    store = RouteStore(max_bytes=2_000)
    rows = np.zeros((10, 2, 2), dtype=np.int16)
    for request in range(5):
        store.add(f"cmpl-{request}-0-xyz", np.arange(10), rows)  # 80 + 80 bytes each
    store.add("cmpl-big-0-xyz", np.arange(100), np.zeros((100, 2, 2), dtype=np.int16))  # evicts the oldest
    assert store.take("cmpl-0-") == [] and len(store.take("cmpl-4-")) == 1
    chunks = [(np.arange(3), _table(3)), (np.array([3, 4]), _table(2, seed=5))]
    answer = dense_routes(chunks, 2, 2)
    table, note = parse_routes(answer, SHAPE, positions=5)
    assert note is None and torch.equal(table[3:], torch.from_numpy(_table(2, seed=5)).to(torch.int16))
    assert dense_routes(chunks + [(np.array([1]), _table(1))], 2, 2) == {"recomputed": True}


def _generate(engine, requests):
    async def go():
        return [await engine.generate(r) for r in requests]  # one after the other: the second hits the cache

    return asyncio.run(go())


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_the_server_reports_the_routes_it_computed(vllm_tiny_server, tiny_checkpoint):
    engine = VLLMServerEngine(vllm_tiny_server.base_url, timeout=120)
    try:
        assert engine.enable_routes() == SHAPE
        prompt = [int(t) for t in torch.randint(10, 400, (300,), generator=torch.Generator().manual_seed(0))]
        first, second = _generate(engine, [GenerationRequest(prompt, 8, seed=s) for s in (1, 2)])
    finally:
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
    cached = (second.routes[:, 0, 0] == MISSING).nonzero().flatten()
    assert len(cached) > 1 and cached[0] == 0, "the second request should reuse the first's cached prompt blocks"
    fill_shared_prefixes([ids, prompt + second.token_ids], [routes.clone(), second.routes])
    assert (second.routes[:-1] != MISSING).all()
    assert torch.equal(second.routes[: len(prompt)], routes[: len(prompt)])
