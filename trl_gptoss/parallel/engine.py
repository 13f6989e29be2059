"""The owner loop ("SP over DP") and ``prepare_context_parallel``.

accelerate keeps seeing plain DDP/FSDP2 over all ranks: every rank loads, generates and scores its own
micro-batch and computes its own loss. Inside an SP group of n ranks, the group runs each member's
micro-batch in turn (owner j at sub-step j), sharded along the sequence; per-token log-probs are gathered to
the owner, whose loss is unchanged; the others add ``0 * gathered.sum()`` so the collectives in backward
stay symmetric. Each rank's parameter gradient is then its shard's share of every owner's loss, and the
all-reduce over the world that DDP/FSDP2 does after the last sub-step gives
``(1/world) * sum_ranks dL_rank/dtheta`` -- exactly the unsharded data-parallel gradient (sinks included:
rank r's share only touches ``sinks[r*Hq/n:(r+1)*Hq/n]``).

Per-token values come from ``selective_logprobs`` inside the model's forward (``trl_gptoss.parallel.head``):
no rank ever holds ``[T/n, V]`` logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# what accelerator.unwrap_model calls: DDP keeps the model in .module, FSDP2 shards it in place
from accelerate.utils import extract_model_from_parallel as _unwrap

from trl_gptoss.parallel.attention import register_ulysses_attention, sharded_forward
from trl_gptoss.parallel.batching import IGNORE_INDEX, pack_rows, pad_rows, pad_to_multiple, shard, unpack_token_values
from trl_gptoss.parallel.comm import gather_lengths, gather_sequence, gather_sequence_no_grad
from trl_gptoss.parallel.config import ContextParallelPlugin
from trl_gptoss.parallel.groups import SequenceParallelGroup, build_sequence_parallel_group
from trl_gptoss.parallel.head import HeadConfig, bare_causal_lm, output_head, token_values_forward

LossFn = Callable[..., torch.Tensor]


@dataclass
class StepResult:
    """This rank's own loss and per-token values ``[B, L]`` (detached; ``[b, t]`` = log p(token t) and the
    entropy of the distribution it was drawn from; ``token_entropies`` is None unless the head returns them)."""

    loss: torch.Tensor
    token_logps: torch.Tensor
    token_entropies: torch.Tensor | None = None


class ContextParallelRunner:
    """Runs forward + backward of each SP-group member's micro-batch, sharded over the group.

    ``head`` (default ``HeadConfig()``: temperature 1, no entropies) says how hidden states become per-token
    values; ``forward_backward`` and ``score`` take another one per call.
    """

    def __init__(
        self,
        model,
        sp: SequenceParallelGroup,
        accelerator=None,
        attention: str | None = None,
        head: HeadConfig | None = None,
    ):
        self.model, self.sp, self.accelerator = model, sp, accelerator
        self.attention = attention or _unwrap(model).config._attn_implementation
        self.head = head if head is not None else HeadConfig()

    def local_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, model=None) -> torch.Tensor:
        """Forward of this rank's shard ``[T/n]`` of one packed row -> logits ``[T/n, V]``. For inspection
        only: the loss and scoring passes go through ``local_token_values`` and never build these logits."""
        with sharded_forward(self.sp):
            out = (model or self.model)(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.logits[0]

    def local_token_values(self, input_ids, positions, labels, model=None, head: HeadConfig | None = None):
        """This rank's shard ``[T/n]`` of one packed row (``labels``: next-token ids, -100 where none) ->
        ``(logp [T/n], entropy [T/n] | None)`` by ``selective_logprobs`` inside the model's forward."""
        model = model or self.model
        with sharded_forward(self.sp), token_values_forward(_unwrap(model)), self._autocast(model):
            return model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                token_labels=labels,
                head_config=head or self.head,
            )

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        loss_fn: LossFn,
        *,
        head: HeadConfig | None = None,
        sync_gradients: bool | None = None,
        routes: torch.Tensor | None = None,
        route_replay=None,
    ) -> StepResult:
        """One micro-batch step. ``input_ids, attention_mask: [B, L]`` (this rank's own batch);
        ``loss_fn(token_logps [B, L]) -> scalar`` -- ``loss_fn(token_logps, token_entropies)`` when the head
        returns entropies -- is called once, on this rank, with differentiable values (entropies differentiable
        only with ``entropy_grad``). Gradients are synchronised after the last sub-step when ``sync_gradients``
        (False to accumulate; None: ``accelerator.sync_gradients``, i.e. what ``accelerator.accumulate``
        decided, else True). ``routes [B, L, layers, top_k]`` (a rollout engine's experts, -1: none) are packed and
        sharded like the tokens and applied by ``route_replay(model, shard_routes [1, T/n, layers, top_k])``, a
        context manager around each owner's forward (every rank of the group passes routes, or none does)."""
        head = head or self.head
        if sync_gradients is None:
            sync_gradients = self.accelerator.sync_gradients if self.accelerator is not None else True
        packed, lengths, members = self._share_batches(input_ids, attention_mask)
        member_routes = self._share_routes(routes, attention_mask, lengths)
        result = None
        for owner, (ids, positions, labels) in enumerate(members):
            last = owner == self.sp.size - 1
            with self._gradient_sync(sync_gradients and last), self._routed(route_replay, member_routes, owner):
                values = self._owner_values(self.model, ids, positions, labels, head)[: lengths[owner]]
                if owner == self.sp.rank:
                    per_token = [unpack_token_values(values[:, k], packed) for k in range(values.shape[1])]
                    loss = loss_fn(*per_token)
                    detached = [v.detach() for v in per_token]
                    result = StepResult(loss.detach(), *detached)
                else:
                    loss = values.sum() * 0.0  # keeps this rank in the gather's backward all-reduce
                self._backward(loss)
        return result

    @torch.no_grad()
    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        model=None,
        head=None,
        *,
        routes=None,
        route_replay=None,
    ):
        """Per-token log-probs ``[B, L]`` of this rank's batch without backward (old / reference log-probs);
        ``(log-probs, entropies)`` when ``head`` (default: the runner's) returns entropies.

        ``model`` (default: the trained one) may be another copy, e.g. the frozen reference model; it is
        switched to this runner's attention, which behaves exactly like the inner one outside SP. ``routes``,
        ``route_replay``: as for ``forward_backward``.
        """
        head = head or self.head
        if model is not None and _unwrap(model).config._attn_implementation != self.attention:
            _unwrap(model).set_attn_implementation(self.attention)
        packed, lengths, members = self._share_batches(input_ids, attention_mask)
        member_routes = self._share_routes(routes, attention_mask, lengths)
        own = None
        for owner, (ids, positions, labels) in enumerate(members):
            with self._routed(route_replay, member_routes, owner, model or self.model):
                values = self._owner_values(model or self.model, ids, positions, labels, head)[: lengths[owner]]
            if owner == self.sp.rank:
                own = [unpack_token_values(values[:, k], packed) for k in range(values.shape[1])]
        return tuple(own) if head.entropy else own[0]

    def _share_batches(self, input_ids, attention_mask):
        """Pack this rank's batch; every member's packed ``(ids, positions, labels)``, padded to a multiple
        of sp (no grad). The lengths are checked after one all-gather, so all ranks raise together."""
        packed = pack_rows(input_ids, attention_mask)
        lengths = gather_lengths(len(packed), self.sp)
        if min(lengths) < self.sp.size:
            raise ValueError(
                f"packed lengths {lengths} of the SP group: every micro-batch needs at least "
                f"sp_size={self.sp.size} tokens"
            )
        longest = max(lengths)
        fills = (0, 0, IGNORE_INDEX)
        own = [
            torch.cat([t, t.new_full((longest - len(packed),), f)])
            for t, f in zip((packed.input_ids, packed.positions, packed.labels), fills)
        ]
        stacked = gather_sequence_no_grad(torch.stack(own)[None], self.sp)  # [n, 3, longest]
        members = [
            [pad_to_multiple(stacked[j, k, : lengths[j]], self.sp.size, fills[k]) for k in range(3)]
            for j in range(self.sp.size)
        ]
        return packed, lengths, members

    def _share_routes(self, routes, attention_mask, lengths) -> list[torch.Tensor] | None:
        """Every member's packed routes ``[T_j, layers, top_k]`` (padded to a multiple of sp with -1), gathered
        like ``_share_batches``'s tokens; None when no routes are given."""
        if routes is None:
            return None
        valid = torch.ones(routes.shape[:2], dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        packed = routes[valid.to(routes.device)].to(torch.int32)  # row-major, as pack_rows packs the tokens
        _, layers, top_k = packed.shape
        longest = max(lengths)
        padded = pad_rows(packed, longest, -1).reshape(1, longest, layers * top_k)
        stacked = gather_sequence_no_grad(padded, self.sp)
        return [
            pad_to_multiple(stacked[j, : lengths[j]].reshape(lengths[j], layers, top_k), self.sp.size, -1)
            for j in range(self.sp.size)
        ]

    def _routed(self, route_replay, member_routes, owner: int, model=None):
        """The owner's forward under ``route_replay`` with this rank's shard of its routes (or nothing)."""
        if member_routes is None:
            return contextlib.nullcontext()
        if route_replay is None:
            raise ValueError("routes were given without route_replay, the context manager that applies them")
        local = shard(member_routes[owner], self.sp.rank, self.sp.size)
        return route_replay(model or self.model, local[None])

    def _autocast(self, model):
        """The autocast the model's prepared forward applies -- accelerate wraps it in ``autocast`` (``bf16:
        true``) -- which ``token_values_forward`` swaps out on a model it wrapped directly (no PEFT wrapper in
        between): the shard's forward runs in the dtype the one-process path computes in. Forward only, as there."""
        if self.accelerator is not None and hasattr(_unwrap(model), "_original_forward"):
            return self.accelerator.autocast()
        return contextlib.nullcontext()

    def _owner_values(self, model, ids, positions, labels, head: HeadConfig):
        """The owner's ``[T, k]`` per-token values (k = 1: log-probs; 2: log-probs, entropies), gathered
        differentiably in one collective. Entropies without ``entropy_grad`` enter detached: the op's entropy
        output then gets no gradient and its backward skips the entropy term."""
        rank, size = self.sp.rank, self.sp.size
        parts = (shard(ids, rank, size), shard(positions, rank, size), shard(labels, rank, size))
        logp, entropy = self.local_token_values(*parts, model=model, head=head)
        if entropy is None:
            values = logp[:, None]
        else:
            values = torch.stack([logp, entropy if head.entropy_grad else entropy.detach()], dim=1)
        return gather_sequence(values, self.sp)

    def _gradient_sync(self, enabled: bool):
        if enabled:
            return contextlib.nullcontext()
        if self.accelerator is not None:
            return self.accelerator.no_sync(self.model)
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            return _fsdp2_no_sync(self.model)
        return getattr(self.model, "no_sync", contextlib.nullcontext)()  # DDP, or a plain module

    def _backward(self, loss):
        if self.accelerator is not None:
            self.accelerator.backward(loss)
        else:
            loss.backward()


@contextlib.contextmanager
def _fsdp2_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _world_size(accelerator) -> int:
    if accelerator is not None:
        return accelerator.num_processes
    return dist.get_world_size() if dist.is_initialized() else 1


def _check_gradients_are_synchronised(model, module, world_size: int) -> None:
    """Each rank's sharded backward leaves only its own slice's share of every gradient; the all-reduce of
    DDP/FSDP2 over the world is what sums the shares. An unwrapped module on several processes would train on
    per-rank partial gradients without any error, so it is refused."""
    from torch.distributed.fsdp import FSDPModule

    if world_size > 1 and model is module and not isinstance(model, FSDPModule):
        raise ValueError(
            f"prepare_context_parallel got an unwrapped {type(model).__name__} on {world_size} processes: its "
            "gradients would stay per-rank partial sums. Wrap it first (accelerator.prepare(model), "
            "torch.nn.parallel.DistributedDataParallel(model) or torch.distributed.fsdp.fully_shard(model))."
        )


def prepare_context_parallel(
    accelerator, model, plugin: ContextParallelPlugin | None = None, head: HeadConfig | None = None
):
    """Validate, register ``"ulysses_<inner>"`` on the model, build the SP groups; return the runner (whose
    per-token values follow ``head``: temperature, entropies, tile size).

    ``model`` may already be wrapped by ``accelerator.prepare`` (DDP) or ``fully_shard`` (FSDP2);
    ``accelerator=None`` uses ``torch.distributed`` directly. All checks run before any collective, so bad
    settings raise the same ``ValueError`` on every rank instead of hanging.
    """
    plugin = plugin if plugin is not None else ContextParallelPlugin.from_env()
    module = _unwrap(model)
    plugin.check_world(_world_size(accelerator))
    plugin.check_model(module.config)
    if getattr(module, "is_activation_checkpointing", False):
        raise ValueError(
            "gradient checkpointing recomputes attention outside the sharded forward; disable "
            "it (context parallelism already divides activation memory by sp_size)"
        )
    _check_gradients_are_synchronised(model, module, _world_size(accelerator))
    attention = register_ulysses_attention(plugin.inner_attention)
    module.set_attn_implementation(attention)
    output_head(bare_causal_lm(module))  # an adapter on lm_head is refused here, on every rank
    group = build_sequence_parallel_group(plugin.sp_size)
    return ContextParallelRunner(model, group, accelerator, attention, head)
