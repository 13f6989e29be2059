"""A trainer-side router that disagrees with the engine's on near-ties: the mismatch R3 removes, made on purpose."""

from __future__ import annotations

import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter


class NearTieFlips:
    """The hooks ``flip_near_ties`` installed: ``count`` tokens flipped so far; ``remove()`` takes them out."""

    def __init__(self, share: float):
        self.share, self.count, self._handles = share, 0, []

    def hook(self, module, args, output):
        logits = output[0]
        top = logits.topk(module.top_k + 1, dim=-1)
        gap = top.values[:, -2] - top.values[:, -1]
        near = gap <= gap.quantile(self.share) if gap.numel() else gap.bool()
        index = top.indices[:, :-1].clone()
        index[near, -1] = top.indices[near, -1]
        self.count += int(near.sum())
        return logits, torch.softmax(logits.gather(-1, index), dim=-1, dtype=logits.dtype), index

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def flip_near_ties(model, share: float = 1 / 3) -> NearTieFlips:
    """Hook every ``GptOssTopKRouter`` of ``model``: on the ``share`` of each forward's tokens whose k-th and
    (k+1)-th logits are closest, route to the (k+1)-th expert instead of the k-th (weights recomputed over the new
    set), which is what numerical noise does to near-ties between two implementations. Hooks added later (a
    routing replay) see the flipped choice and may replace it."""
    flips = NearTieFlips(share)
    for module in model.modules():
        if isinstance(module, GptOssTopKRouter):
            flips._handles.append(module.register_forward_hook(flips.hook))
    return flips
