"""``sp_size > 1``: each micro-batch's loss pass runs through ``trl_gptoss.parallel``'s owner loop.

TRL refuses sequence parallelism because it builds model inputs after generation; here the whole rollout
batch already exists when the loss runs, so the packed micro-batch is sharded along the sequence by the runner
(sink-aware Ulysses), the per-token log-probs and entropies of the tempered distribution (computed by
``selective_logprobs``, never as ``[T, V]`` logits) come back to their owner rank, and TRL's own
``_compute_loss`` turns them into the loss. The runner must run backward itself (the SP group interleaves its members'
micro-batches), so Trainer's ``backward`` receives a leaf holding the loss value: it touches no parameter.
"""

from __future__ import annotations

import contextlib

import torch

from trl_gptoss.parallel import ContextParallelPlugin, HeadConfig, prepare_context_parallel
from trl_gptoss.trainer.replay import flip_fraction


def check_sequence_parallel(args, model_config) -> ContextParallelPlugin:
    """Refuse settings the SP loss pass would silently get wrong; return the plugin."""
    plugin = ContextParallelPlugin(sp_size=args.sp_size, inner_attention=args.attn_implementation)
    plugin.check_model(model_config)
    unsupported = {
        "top_entropy_quantile < 1 (its quantile spans every rank's micro-batch; the SP owner loop computes the "
        "entropies of one micro-batch at a time)": args.top_entropy_quantile < 1.0,
        "use_adaptive_entropy (its window entropy is reduced over all ranks, which are inside the owner loop's "
        "collectives then)": bool(args.use_adaptive_entropy),
        "router_aux_loss_coef != 0 (SP computes no router aux loss)": bool(args.router_aux_loss_coef),
        "gradient_checkpointing (SP already divides activations by sp_size)": bool(args.gradient_checkpointing),
        "beta != 0 (reference log-probs are not sharded yet)": args.beta != 0.0,
        "num_iterations > 1 or batches reused across optimizer steps (old log-probs are not sharded yet)": (
            args.needs_old_logprobs_pass
        ),
    }
    refused = [what for what, bad in unsupported.items() if bad]
    if refused:
        raise ValueError(f"sp_size={args.sp_size} does not support: {'; '.join(refused)}")
    return plugin


def sequence_parallel_head(args) -> HeadConfig:
    """The runner's per-token values for TRL's loss: log-probs and entropies of ``softmax(logits /
    temperature)``; the entropies carry gradient only when the entropy bonus is on (``entropy_coef != 0``),
    else they feed the ``entropy`` metric alone and their backward term is skipped."""
    return HeadConfig(
        temperature=args.temperature,
        entropy=True,
        entropy_grad=args.entropy_coef != 0,
        cast_to_fp32=args.cast_lm_head_to_fp32,
        top_k=args.engine_top_k,
        top_p=args.top_p,
    )


class SequenceParallelLoss:
    """Runs ``trainer._compute_loss`` on log-probs and entropies computed by the SP runner (created on first
    use, when the model is wrapped for data parallelism)."""

    def __init__(self, plugin: ContextParallelPlugin):
        self.plugin = plugin
        self.runner = None

    @classmethod
    def for_config(cls, args, model_config) -> SequenceParallelLoss | None:
        """The SP loss of a run with ``sp_size > 1`` (its settings checked), else None."""
        return cls(check_sequence_parallel(args, model_config)) if args.sp_size > 1 else None

    def __call__(self, trainer, model, inputs: dict) -> torch.Tensor:
        if self.runner is None:
            head = sequence_parallel_head(trainer.args)
            self.runner = prepare_context_parallel(trainer.accelerator, model, self.plugin, head)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        completion = inputs["completion_ids"].size(1)

        def loss_fn(token_logps: torch.Tensor, token_entropies: torch.Tensor) -> torch.Tensor:
            # [B, L]: log p(input_ids[b, t]) and the entropy of the distribution it was drawn from
            completion_logps, completion_entropies = token_logps[:, -completion:], token_entropies[:, -completion:]
            return trainer.compute_loss_from_logps(model, inputs, completion_logps, completion_entropies)

        routes, records = inputs.get("routing_indices"), []
        result = self.runner.forward_backward(
            input_ids, attention_mask, loss_fn, routes=routes, route_replay=_recording(trainer, records)
        )
        if records and records[0].allow_missing:  # R3: the shards' replays of every owner's micro-batch
            trainer._log_metrics({"rollout/route_flip_fraction": flip_fraction(records, trainer.accelerator)})
        return result.loss.detach().clone().requires_grad_(True)


def _recording(trainer, records: list):
    """The runner's ``route_replay``: the trainer's replay on one shard, its ``RoutingRecord`` kept."""
    if trainer.routing_replay is None:
        return None

    @contextlib.contextmanager
    def replay(model, shard_routes):
        with trainer.routing_replay.replay(model, shard_routes) as record:
            records.append(record)
            yield record

    return replay
