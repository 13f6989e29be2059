"""MoE routing replay (R3): record every router's top-k experts in one forward, route a later forward the same way.

RL on an MoE compares log-probs from two passes (rollout/old-policy vs training). Small numerical differences
flip near-tied top-k choices, so the two passes can run different experts for the same token and the importance
ratio measures routing noise instead of the policy change. Replay pins the experts: in the replayed pass each
router still computes its logits, but the top-k *indices* come from the record, and the routing weights are
recomputed from the current logits at those indices, ``softmax(logits[t, idx_t])`` (GPT-OSS normalises over the
selected experts only), so the router keeps its gradient.

Usage::

    with record_routing(model) as record:        # e.g. the old-log-prob pass
        old_logits = model(**batch).logits
    with replay_routing(model, record):          # the training pass routes exactly like the recorded one
        loss = loss_fn(model(**batch).logits); loss.backward()

Both are forward hooks on ``GptOssTopKRouter`` modules, removed when the ``with`` block exits (no source changes).
Layers are matched by their order in the model, so a record survives PEFT/FSDP wrappers that prefix names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

FORMAT_VERSION = 1


def _routers(model: torch.nn.Module) -> list[tuple[str, GptOssTopKRouter]]:
    routers = [(name, module) for name, module in model.named_modules() if isinstance(module, GptOssTopKRouter)]
    if not routers:
        raise ValueError(f"{type(model).__name__} has no GptOssTopKRouter: routing replay needs a GPT-OSS model")
    return routers


def compact_index_dtype(num_experts: int) -> torch.dtype:
    """Smallest dtype that holds expert ids ``0..num_experts-1`` (uint8 up to 256 experts, else int16)."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} does not fit int16; routing records support at most 32768")


@dataclass
class RoutingRecord:
    """Per-layer top-k expert ids of one forward, plus the model shape they belong to.

    indices[i]: ``[num_tokens, top_k]`` compact integer tensor for the i-th router in module order (tokens are
    the router's flattened ``batch * seq`` rows, padding and packed documents included); ``None`` until recorded.
    layer_names: the routers' module names (for error messages). num_experts, top_k, hidden_size: the model's.
    """

    layer_names: list[str]
    num_experts: int
    top_k: int
    hidden_size: int
    indices: list[torch.Tensor | None] = field(default_factory=list)
    allow_missing: bool = False  # rows of -1 (a rollout engine reported no route): the router decides them
    replayed_rows: int = 0  # rows replayed from the record, and of those, the ones the router would have
    flipped_rows: int = 0  # routed to another expert set (counted per layer and forward by the replay hook)

    def __post_init__(self):
        if not self.indices:
            self.indices = [None] * len(self.layer_names)
        if len(self.indices) != len(self.layer_names):
            raise ValueError(f"record has {len(self.indices)} index tensors for {len(self.layer_names)} layers")

    @classmethod
    def empty_for(cls, model: torch.nn.Module) -> RoutingRecord:
        routers = _routers(model)
        first = routers[0][1]
        return cls([name for name, _ in routers], first.num_experts, first.top_k, first.hidden_dim)

    @classmethod
    def from_layer_indices(
        cls, model: torch.nn.Module, indices: Sequence[torch.Tensor], allow_missing: bool = False
    ) -> RoutingRecord:
        """Build a record from externally reported experts (e.g. a rollout engine): one ``[num_tokens, top_k]``
        tensor per router layer, in layer order. Validated like a recorded one. ``allow_missing``: a row of
        ``-1`` is a token without a route (the router's own choice is used for it)."""
        record = cls.empty_for(model)
        record.allow_missing = allow_missing
        if len(indices) != len(record.layer_names):
            raise ValueError(f"got routing for {len(indices)} layers, the model has {len(record.layer_names)} routers")
        record.indices = [record._checked(i, torch.as_tensor(t)) for i, t in enumerate(indices)]
        return record

    @property
    def num_tokens(self) -> int | None:
        recorded = [t for t in self.indices if t is not None]
        return recorded[0].shape[0] if recorded else None

    def describe_layer(self, layer: int) -> str:
        return f"layer {layer} ({self.layer_names[layer]})"

    def _checked(
        self, layer: int, index: torch.Tensor, num_tokens: int | None = None, check_range: bool = True
    ) -> torch.Tensor:
        """Validate one layer's ids (shape ``[num_tokens, top_k]``, range ``[0, num_experts)``); return compact.
        ``check_range=False`` skips the range test (a host sync) for ids already validated or made by topk."""
        rows = "num_tokens" if num_tokens is None else num_tokens
        expected = f"[{rows}, {self.top_k}]"
        bad_shape = (
            index.dim() != 2
            or index.shape[1] != self.top_k
            or (num_tokens is not None and index.shape[0] != num_tokens)
        )
        if bad_shape:
            raise ValueError(
                f"{self.describe_layer(layer)}: routing indices must have shape {expected}, "
                f"got {tuple(index.shape)}; replay a record of the same batch, packing and model"
            )
        if index.dtype.is_floating_point or index.dtype == torch.bool:
            raise ValueError(f"{self.describe_layer(layer)}: routing indices must be integers, got {index.dtype}")
        low = -1 if self.allow_missing else 0
        if check_range and index.numel() and (int(index.min()) < low or int(index.max()) >= self.num_experts):
            raise ValueError(
                f"{self.describe_layer(layer)}: expert ids must lie in [0, {self.num_experts})"
                f"{' or be -1 (no route)' if self.allow_missing else ''}, got "
                f"[{int(index.min())}, {int(index.max())}] (expected shape {expected})"
            )
        return index.detach().to(torch.int16 if self.allow_missing else compact_index_dtype(self.num_experts))

    @property
    def flip_fraction(self) -> float:
        """Of the rows replayed from the record, the fraction whose recorded experts differ from the router's."""
        return self.flipped_rows / self.replayed_rows if self.replayed_rows else 0.0

    def check_compatible(self, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` if this record cannot drive ``model``'s routers (other model or missing layers)."""
        other = RoutingRecord.empty_for(model)
        mine = (len(self.layer_names), self.num_experts, self.top_k, self.hidden_size)
        theirs = (len(other.layer_names), other.num_experts, other.top_k, other.hidden_size)
        if mine != theirs:
            raise ValueError(
                "routing record is from another model: (layers, experts, top_k, hidden) = "
                f"{mine}, this model has {theirs}; expected indices of shape [num_tokens, {other.top_k}] per layer"
            )
        missing = [self.describe_layer(i) for i, t in enumerate(self.indices) if t is None]
        if missing:
            raise ValueError(f"routing record has no indices for {', '.join(missing)}; record a full forward pass")

    def narrow(self, start: int, length: int) -> RoutingRecord:
        """The record of token rows ``[start, start + length)`` in every layer (e.g. one micro-batch of a
        ``[B, T]`` batch is rows ``b0*T .. b1*T``)."""
        total = self.num_tokens or 0
        if start < 0 or length < 0 or start + length > total:
            raise ValueError(f"cannot take rows [{start}, {start + length}) of a record with {total} tokens")
        return RoutingRecord(
            list(self.layer_names),
            self.num_experts,
            self.top_k,
            self.hidden_size,
            [None if t is None else t.narrow(0, start, length) for t in self.indices],
            allow_missing=self.allow_missing,
        )

    def to_dict(self) -> dict:
        """Plain dict of tensors and ints (``torch.save``-able, loads with ``weights_only=True``)."""
        return {
            "format_version": FORMAT_VERSION,
            "layer_names": list(self.layer_names),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "hidden_size": self.hidden_size,
            "indices": [None if t is None else t.cpu() for t in self.indices],
            "allow_missing": self.allow_missing,
        }

    @classmethod
    def from_dict(cls, state: dict) -> RoutingRecord:
        if state.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"routing record format_version {state.get('format_version')!r} is not supported; "
                f"expected {FORMAT_VERSION}"
            )
        record = cls(
            list(state["layer_names"]),
            int(state["num_experts"]),
            int(state["top_k"]),
            int(state["hidden_size"]),
            allow_missing=bool(state.get("allow_missing", False)),
        )
        record.indices = [None if t is None else record._checked(i, t) for i, t in enumerate(state["indices"])]
        return record

    def save(self, path) -> None:
        torch.save(self.to_dict(), path)

    @classmethod
    def load(cls, path) -> RoutingRecord:
        return cls.from_dict(torch.load(path, weights_only=True))


def _record_hook(record: RoutingRecord, layer: int):
    def hook(module, args, output):
        index = record._checked(layer, output[2], check_range=False)
        previous = record.indices[layer]
        # A second call with identical routing is gradient-checkpoint recomputation; anything else is a second
        # forward, which one record cannot describe.
        if previous is not None and not (previous.shape == index.shape and torch.equal(previous, index)):
            raise ValueError(
                f"{record.describe_layer(layer)} routed twice with different tokens while recording; "
                "use one record_routing() block per forward pass"
            )
        record.indices[layer] = index

    return hook


def _replay_hook(record: RoutingRecord, layer: int):
    def hook(module, args, output):
        router_logits, own = output[0], output[2]
        index = record._checked(layer, record.indices[layer], num_tokens=router_logits.shape[0], check_range=False)
        index = index.to(device=router_logits.device, dtype=torch.long)
        if record.allow_missing:
            index = _own_where_missing(record, index, own.to(torch.long))
        selected = router_logits.gather(-1, index)
        scores = torch.softmax(selected, dim=-1, dtype=selected.dtype)
        return router_logits, scores, index

    return hook


def _own_where_missing(record: RoutingRecord, index: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Rows of -1 take the router's own experts; the others are counted, and compared with the router's
    choice as sets (the order of the top-k does not change the layer's output)."""
    missing = (index < 0).any(dim=-1)
    replayed = ~missing
    differs = (index.sort(dim=-1).values != own.sort(dim=-1).values).any(dim=-1) & replayed
    record.replayed_rows += int(replayed.sum())
    record.flipped_rows += int(differs.sum())
    return torch.where(missing[:, None], own, index)


@contextlib.contextmanager
def _hooks(model, make_hook, record) -> Iterator[RoutingRecord]:
    handles = [
        router.register_forward_hook(make_hook(record, layer)) for layer, (_, router) in enumerate(_routers(model))
    ]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def record_routing(model: torch.nn.Module) -> contextlib.AbstractContextManager[RoutingRecord]:
    """Context manager yielding a ``RoutingRecord`` filled by the forward pass run inside the block."""
    return _hooks(model, _record_hook, RoutingRecord.empty_for(model))


def replay_routing(model: torch.nn.Module, record: RoutingRecord) -> contextlib.AbstractContextManager[RoutingRecord]:
    """Context manager: every router inside the block uses ``record``'s experts (routing weights recomputed
    from the current logits at those experts). Raises ``ValueError`` if the record does not fit the model;
    a forward whose token count differs from the record raises ``ValueError`` naming the layer and shape."""
    if not isinstance(record, RoutingRecord):
        raise ValueError(f"replay_routing needs a RoutingRecord, got {type(record).__name__}")
    record.check_compatible(model)
    return _hooks(model, _replay_hook, record)
