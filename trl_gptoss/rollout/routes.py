"""Rollout routes (R3): the experts the engine's routers chose for every position of a trajectory.

A route table is ``int16 [positions, layers, top_k]``; ``-1`` marks a position whose route the engine did not
report (a prefix-cache hit whose blocks it no longer knew, a preempted request, the last token of a trajectory,
which is never fed back). The vLLM worker captures them (``vllm_worker/gptoss_vllm_routes.py``);
``VLLMServerEngine`` asks for each request's table; here they are checked against the model's shape and merged
over the turns of one conversation (a position keeps the route of the first request that computed it: later
requests read that position's cached KV, so that is the route every later token saw). Positions served from the
engine's prefix cache are filled by the worker from the request that computed them (a prompt a GRPO group shares
is computed once, whichever process sent it).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass

import numpy as np
import torch

MISSING = -1


@dataclass(frozen=True)
class RouteShape:
    """What a route table must look like for the served model."""

    layers: int
    top_k: int
    num_experts: int

    @classmethod
    def from_answer(cls, answer) -> RouteShape:
        if not isinstance(answer, dict) or not all(isinstance(answer.get(k), int) for k in _SHAPE_KEYS):
            raise ValueError(f"the server's route capture answered {str(answer)[:200]!r}, not {_SHAPE_KEYS}")
        return cls(answer["layers"], answer["top_k"], answer["num_experts"])

    @classmethod
    def of_model(cls, model) -> RouteShape:
        config = model.config
        return cls(config.num_hidden_layers, config.num_experts_per_tok, config.num_local_experts)


_SHAPE_KEYS = ("layers", "top_k", "num_experts")


def token_digest(token_ids) -> str:
    """The digest a route answer carries of the token ids it routes (int64 little-endian, blake2b-128, hex): the
    worker's ``gptoss_vllm_routes._token_digest`` computes the same."""
    return hashlib.blake2b(np.asarray(token_ids, dtype="<i8").tobytes(), digest_size=16).hexdigest()


def parse_routes(answer, shape: RouteShape, token_ids) -> tuple[torch.Tensor | None, str | None]:
    """One request's route answer -> ``(table [positions, layers, top_k] int16, None)`` or ``(None, reason)``.

    ``token_ids``: the request's prompt plus sampled tokens (``positions`` of them). Refused, never replayed: a
    table longer than that, of another layer count or top-k, with dims that are not plain non-negative integers,
    with expert ids out of range, a row naming one expert twice or only partly routed, or whose digest of the
    token ids it routes differs from this request's (the routes of other tokens). A shorter one is padded with
    ``-1``."""
    positions = len(token_ids)
    if answer is None:
        return None, "the server captured no routes for this request"
    if not isinstance(answer, dict):
        return None, f"the route answer is {type(answer).__name__}, not an object"
    for flag, reason in _REFUSED_FLAGS.items():
        if answer.get(flag):
            return None, reason
    dims = answer.get("shape")
    if not isinstance(dims, list) or len(dims) != 3 or not all(type(d) is int and d >= 0 for d in dims):
        return None, f"the route answer's shape {str(dims)[:80]} is not three non-negative integers"
    try:
        flat = np.frombuffer(base64.b64decode(answer["b64"], validate=True), dtype=np.int16)
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"the route answer is malformed ({type(exc).__name__}: {exc})"
    if dims[1:] != [shape.layers, shape.top_k] or flat.size != dims[0] * dims[1] * dims[2]:
        wanted = f"[positions, {shape.layers}, {shape.top_k}]"
        return None, f"routes of shape {dims} ({flat.size} values) do not fit {wanted}"
    if dims[0] > positions:
        return None, f"routes for {dims[0]} positions, the request has {positions} tokens"
    if answer.get("tokens_digest") != token_digest(token_ids[: dims[0]]):
        return None, f"the routes are of other tokens (their digest is not that of this request's first {dims[0]})"
    table = torch.from_numpy(flat.reshape(dims).copy())
    problem = _table_problem(table, shape.num_experts)
    return (None, problem) if problem else (_padded(table, positions), None)


EVICTED = "the server's route store dropped this request's routes before they were taken (it was full)"
_REFUSED_FLAGS = {
    "recomputed": "the request was preempted and recomputed (its positions have two routes)",
    "ambiguous": "two requests carried this request's id (a retried request)",
    "evicted": EVICTED,
}


def new_tag_key() -> bytes:
    """A client's key for the tags of the requests whose routes the server should keep (``route_tag``)."""
    return secrets.token_bytes(32)


def route_tag(key: bytes) -> str:
    """A fresh ``request_id`` that asks the server to keep the request's routes: a nonce and its MAC under
    ``key`` (the worker's ``tag_mac``); a completion without one, from anyone, is not stored."""
    nonce = secrets.token_hex(16)
    return nonce + hmac.new(key, nonce.encode("ascii"), hashlib.sha256).hexdigest()[:32]


def _table_problem(table: torch.Tensor, num_experts: int) -> str | None:
    """Why ``table`` cannot be replayed: expert ids out of range, a row naming one expert twice, a row routed
    only in part; ``None`` when it can."""
    if not table.numel():
        return None
    if int(table.min()) < MISSING or int(table.max()) >= num_experts:
        return f"expert ids outside [0, {num_experts}) in the route answer"
    ordered = table.sort(dim=-1).values
    missing = ordered == MISSING
    if (missing.any(-1) & ~missing.all(-1)).any():
        return "a route row names fewer experts than top-k (partly -1)"
    if ((ordered[..., 1:] == ordered[..., :-1]) & ~missing[..., 1:]).any():
        return "a route row names one expert twice"
    return None


class TrajectoryRoutes:
    """The route table of one conversation, grown turn by turn; ``notes`` says why routes are missing."""

    def __init__(self):
        self.table: torch.Tensor | None = None
        self.notes: list[str] = []

    def add_turn(self, routes: torch.Tensor | None, note: str | None, turn: int) -> None:
        """Merge one request's table (positions from 0): positions already routed keep their route."""
        if note is not None:
            self.notes.append(f"turn {turn}: {note}")
        if routes is None:
            return
        if self.table is None:
            self.table = routes.clone()
            return
        known = self.table.shape[0]
        if routes.shape[0] > known:
            self.table = torch.cat([self.table, routes[known:]])
        overlap = self.table[: min(known, routes.shape[0])]
        unknown = overlap[:, 0, 0] == MISSING
        overlap[unknown] = routes[: overlap.shape[0]][unknown]

    def finish(self, positions: int) -> torch.Tensor | None:
        """The table over ``positions`` (prompt + completion), ``-1`` where no request routed a position."""
        return None if self.table is None else _padded(self.table[:positions], positions)


def _padded(table: torch.Tensor, positions: int) -> torch.Tensor:
    """``table`` with rows of ``-1`` appended up to ``positions``."""
    missing = positions - table.shape[0]
    if missing <= 0:
        return table
    return torch.cat([table, torch.full((missing, *table.shape[1:]), MISSING, dtype=table.dtype)])


def missing_counts(tables: list[torch.Tensor | None], lengths: list[int]) -> tuple[int, int]:
    """``(missing, counted)``: positions whose route counts (all but each trajectory's last token), and how many of
    them have none."""
    counted = sum(max(n - 1, 0) for n in lengths)
    missing = 0
    for table, n in zip(tables, lengths, strict=True):
        missing += max(n - 1, 0) if table is None else int((table[: max(n - 1, 0), 0, 0] == MISSING).sum())
    return missing, counted
