"""R3 inside GRPO: the old-log-prob pass records each router's experts, the loss pass replays them.

The record travels with the batch as ``routing_indices: [B, L, num_layers, top_k]`` (compact ints), so TRL's
shuffle and split of the generation batch (dim 0) keep every row's experts with the row.
"""

from __future__ import annotations

import torch

from trl_gptoss.experts.routing import RoutingRecord, record_routing, replay_routing
from trl_gptoss.rollout.weights.names import unwrap


class RoutingReplay:
    """``arm()`` before a generation round; the next log-prob pass outside the loss is recorded; ``take()``
    returns its indices (None when no such pass ran, i.e. on-policy)."""

    def __init__(self):
        self.armed = False
        self._indices = None

    def arm(self) -> None:
        self.armed, self._indices = True, None

    def take(self) -> torch.Tensor | None:
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
        logps = torch.cat([r[0] for r in results], dim=0)
        entropies = None if results[0][1] is None else torch.cat([r[1] for r in results], dim=0)
        aux = None if results[0][2] is None else torch.stack([r[2] for r in results]).mean()
        return logps, entropies, aux

    @staticmethod
    def replay(model, routing_indices: torch.Tensor):
        """Context manager: the forward inside routes ``[b, L]`` tokens exactly as recorded."""
        rows, length, layers, top_k = routing_indices.shape
        per_layer = [routing_indices[:, :, layer].reshape(rows * length, top_k) for layer in range(layers)]
        return replay_routing(model, RoutingRecord.from_layer_indices(unwrap(model), per_layer))
