"""Routing replay inside GRPO: which experts the training passes use for each token.

- ``routing_replay: old_logprob`` (``RoutingReplay``, verl's R2): the old-log-prob pass records each router's
  experts, the loss pass replays them.
- ``routing_replay: rollout`` (``RolloutRouteReplay``, R3): the rollout engine reported its routers' experts for
  every position (``trl_gptoss.rollout.routes``); they are aligned to TRL's padded batch and replayed in the
  old-log-prob pass (when one runs) and the loss pass. Positions without a route (padding, the last token of a
  trajectory, a preempted request, a prefix-cache block the server no longer knew) fall back to the router.

Either way the record travels with the batch as ``routing_indices: [B, L, num_layers, top_k]``, so TRL's
shuffle and split of the generation batch (dim 0) keep every row's experts with the row. Replay pins the expert
*indices* only: the routing weights are recomputed from the current router logits, so the router keeps its
gradient.
"""

from __future__ import annotations

import torch

from trl_gptoss.experts.routing import RoutingRecord, record_routing, replay_routing
from trl_gptoss.rollout.routes import MISSING, RouteShape, missing_counts
from trl_gptoss.rollout.weights.names import unwrap


def replay(model, routing_indices: torch.Tensor, allow_missing: bool = False):
    """Context manager yielding the ``RoutingRecord``: the forward inside routes ``[b, L]`` tokens as
    ``routing_indices [b, L, layers, top_k]`` says (rows of -1, with ``allow_missing``: as the router says)."""
    rows, length, layers, top_k = routing_indices.shape
    per_layer = [routing_indices[:, :, layer].reshape(rows * length, top_k) for layer in range(layers)]
    record = RoutingRecord.from_layer_indices(unwrap(model), per_layer, allow_missing=allow_missing)
    return replay_routing(model, record)


class RoutingReplay:
    """R2. ``arm()`` before a generation round; the next log-prob pass outside the loss is recorded;
    ``take(output)`` returns its indices (None when no such pass ran, i.e. on-policy)."""

    allow_missing = False

    def __init__(self):
        self.armed = False
        self._indices = None

    def arm(self) -> None:
        self.armed, self._indices = True, None

    def take(self, output: dict | None = None) -> torch.Tensor | None:
        self.armed = False
        indices, self._indices = self._indices, None
        return indices

    def record(self, logps_fn, model, input_ids, attention_mask, logits_to_keep, batch_size, *args, **kwargs):
        """Run ``logps_fn`` chunk by chunk (``batch_size`` rows) with one routing record per forward."""
        self.armed = False
        batch_size = batch_size or input_ids.size(0)
        results, indices = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            with record_routing(model) as record:
                results.append(logps_fn(model, ids, mask, logits_to_keep, None, *args, **kwargs))
            rows, length = ids.shape
            indices.append(torch.stack([t.view(rows, length, -1) for t in record.indices], dim=2))
        self._indices = torch.cat(indices, dim=0)
        return _joined(results)

    def replay(self, model, routing_indices: torch.Tensor):
        """Context manager: the forward inside routes ``[b, L]`` tokens exactly as recorded."""
        return replay(model, routing_indices)


class RolloutRouteReplay:
    """R3. ``keep(rollouts)`` takes a generation batch's route tables (its metrics: the missing fraction);
    ``arm()``/``record(...)`` replay them in the old-log-prob pass when one runs; ``take(output)`` returns them
    aligned to TRL's padded ``[B, P + C]`` layout; ``replay`` applies them in the loss pass."""

    allow_missing = True

    def __init__(self, shape: RouteShape, max_missing: float = 1.0):
        self.shape = shape
        self.max_missing = max_missing  # routes_missing_max_fraction
        self.armed = False
        self._batch: list[tuple[list[int], list[int], torch.Tensor | None]] | None = None

    def keep(self, rollouts, collectives) -> dict[str, float]:
        """Hold this batch's routes (token ids kept to prove the alignment); returns its metrics, over every process
        (``collectives``: the accelerator). Raises on every process when more than ``max_missing`` of the batch's
        positions have no route (the fraction is the same everywhere)."""
        self._batch = [(r.prompt_ids, r.completion_ids, r.routes) for r in rollouts]
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
        counts = missing_counts([r.routes for r in rollouts], lengths)
        missing = summed_fraction(counts, collectives)
        if missing > self.max_missing:
            notes = sorted({note for r in rollouts for note in r.route_notes})[:3]
            raise RuntimeError(
                f"routing_replay='rollout': {missing:.1%} of this batch's positions have no route from the engine, "
                f"above routes_missing_max_fraction={self.max_missing} -- the replay would mostly be the trainer's "
                f"own routing. This process's reasons: {notes or ['none given (no route answer)']}. Fix the server "
                "(its log; --enforce-eager; the route store), or raise routes_missing_max_fraction (1.0: never fail)"
            )
        return {"rollout/routes_missing_fraction": missing}

    def arm(self) -> None:
        self.armed = True

    def take(self, output: dict) -> torch.Tensor:
        self.armed = False
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        return self.aligned(input_ids, output["completion_ids"].shape[1])

    def aligned(self, input_ids: torch.Tensor, completion_length: int) -> torch.Tensor:
        """``[B, T, layers, top_k]`` int16 for TRL's ``input_ids [B, T]`` (prompts left-padded to ``T - C``,
        completions right-padded to ``C``); -1 on padding and wherever the engine gave no route. Raises when a
        row's ids are not the rollout's: routes are never replayed misaligned."""
        if self._batch is None or len(self._batch) != input_ids.shape[0]:
            held = None if self._batch is None else len(self._batch)
            raise RuntimeError(f"routing replay holds routes for {held} rollouts, the batch has {input_ids.shape[0]}")
        rows, length = input_ids.shape
        prompt_end = length - completion_length
        out = torch.full((rows, length, self.shape.layers, self.shape.top_k), MISSING, dtype=torch.int16)
        for row, (prompt_ids, completion_ids, routes) in enumerate(self._batch):
            start, end = prompt_end - len(prompt_ids), prompt_end + len(completion_ids)
            if start < 0 or end > length or input_ids[row, start:end].tolist() != [*prompt_ids, *completion_ids]:
                raise RuntimeError(
                    f"row {row}: the batch's token ids [{rows}, {length}] are not the rollout's at [{start}, {end}); "
                    "its routes would be replayed misaligned"
                )
            if routes is not None:
                out[row, start:end] = routes
        return out.to(input_ids.device)

    def record(self, logps_fn, model, input_ids, attention_mask, logits_to_keep, batch_size, *args, **kwargs):
        """The old-log-prob pass, chunk by chunk (``batch_size`` rows), each routed as the engine routed it."""
        self.armed = False
        indices = self.aligned(input_ids, logits_to_keep)
        batch_size = batch_size or input_ids.size(0)
        results = []
        for start in range(0, input_ids.size(0), batch_size):
            part = slice(start, start + batch_size)
            with self.replay(model, indices[part]):
                ids, mask = input_ids[part], attention_mask[part]
                results.append(logps_fn(model, ids, mask, logits_to_keep, None, *args, **kwargs))
        return _joined(results)

    def replay(self, model, routing_indices: torch.Tensor):
        return replay(model, routing_indices, allow_missing=True)


def summed_fraction(counts: tuple[int, int], collectives) -> float:
    """``sum(part) / sum(whole)`` of ``counts = (part, whole)`` over every process (0 when nothing was counted)."""
    device = getattr(collectives, "device", "cpu")
    part, whole = collectives.gather(torch.tensor([counts], dtype=torch.float64, device=device)).sum(dim=0).tolist()
    return part / whole if whole else 0.0


def flip_fraction(records, collectives) -> float:
    """Of the rows the ``RoutingRecord``s replayed, over every process, the share the router would have routed
    elsewhere."""
    return summed_fraction((sum(r.flipped_rows for r in records), sum(r.replayed_rows for r in records)), collectives)


def _joined(results: list[tuple]) -> tuple:
    """TRL's ``(logps, entropies, aux_loss)`` of a pass run chunk by chunk: rows concatenated, aux averaged."""
    logps = torch.cat([r[0] for r in results], dim=0)
    entropies = None if results[0][1] is None else torch.cat([r[1] for r in results], dim=0)
    aux = None if results[0][2] is None else torch.stack([r[2] for r in results]).mean()
    return logps, entropies, aux


def routing_replay_for(args, model):
    """The replay ``args.routing_replay`` asks for (``None`` when off)."""
    if args.routing_replay == "old_logprob":
        return RoutingReplay()
    if args.routing_replay == "rollout":
        return RolloutRouteReplay(RouteShape.of_model(unwrap(model, peft=True)), args.routes_missing_max_fraction)
    return None
