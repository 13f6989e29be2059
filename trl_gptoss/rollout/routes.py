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


def parse_routes(answer, shape: RouteShape, positions: int) -> tuple[torch.Tensor | None, str | None]:
    """One request's route answer -> ``(table [positions, layers, top_k] int16, None)`` or ``(None, reason)``.

    ``positions``: the request's prompt plus sampled tokens. A table longer than that, of another layer count or
    top-k, or with expert ids out of range is refused (never replayed misaligned); a shorter one is padded
    with ``-1``."""
    if answer is None:
        return None, "the server captured no routes for this request"
    if not isinstance(answer, dict):
        return None, f"the route answer is {type(answer).__name__}, not an object"
    if answer.get("recomputed"):
        return None, "the request was preempted and recomputed (its positions have two routes)"
    if answer.get("ambiguous"):
        return None, "two requests carried this request's id (a retried request)"
    try:
        dims = [int(d) for d in answer["shape"]]
        flat = np.frombuffer(base64.b64decode(answer["b64"], validate=True), dtype=np.int16)
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"the route answer is malformed ({type(exc).__name__}: {exc})"
    if len(dims) != 3 or dims[1:] != [shape.layers, shape.top_k] or flat.size != int(np.prod(dims)):
        wanted = f"[positions, {shape.layers}, {shape.top_k}]"
        return None, f"routes of shape {dims} ({flat.size} values) do not fit {wanted}"
    if dims[0] > positions:
        return None, f"routes for {dims[0]} positions, the request has {positions} tokens"
    table = torch.from_numpy(flat.reshape(dims).copy())
    if table.numel() and (int(table.min()) < MISSING or int(table.max()) >= shape.num_experts):
        return None, f"expert ids outside [0, {shape.num_experts}) in the route answer"
    return _padded(table, positions), None


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
