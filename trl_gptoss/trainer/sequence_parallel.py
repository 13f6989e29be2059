"""``sp_size > 1``: each micro-batch's loss pass runs through ``trl_gptoss.parallel``'s owner loop.

TRL refuses sequence parallelism because it builds model inputs after generation; here the whole rollout
batch already exists when the loss runs, so the packed micro-batch is sharded along the sequence by the runner
(sink-aware Ulysses), the per-token log-probs come back to their owner rank, and TRL's own ``_compute_loss``
turns them into the loss. The runner must run backward itself (the SP group interleaves its members'
micro-batches), so Trainer's ``backward`` receives a leaf holding the loss value: it touches no parameter.
"""

from __future__ import annotations

import torch

from trl_gptoss.parallel import ContextParallelPlugin, prepare_context_parallel


def check_sequence_parallel(args, model_config) -> ContextParallelPlugin:
    """Refuse settings the SP loss pass would silently get wrong; return the plugin."""
    plugin = ContextParallelPlugin(sp_size=args.sp_size, inner_attention=args.attn_implementation)
    plugin.check_model(model_config)
    unsupported = {
        "temperature != 1.0 (the SP log-probs are untempered)": args.temperature != 1.0,
        "entropy_coef != 0 or top_entropy_quantile < 1 (SP computes no entropies)": args.entropy_coef != 0
        or args.top_entropy_quantile < 1.0,
        "router_aux_loss_coef != 0 (SP computes no router aux loss)": bool(args.router_aux_loss_coef),
        "gradient_checkpointing (SP already divides activations by sp_size)": bool(args.gradient_checkpointing),
        "beta != 0 (reference log-probs are not sharded yet)": args.beta != 0.0,
        "num_iterations > 1 or off-policy batches (old log-probs are not sharded yet)": not args.strictly_on_policy,
    }
    refused = [what for what, bad in unsupported.items() if bad]
    if refused:
        raise ValueError(f"sp_size={args.sp_size} does not support: {'; '.join(refused)}")
    return plugin


class SequenceParallelLoss:
    """Runs ``trainer._compute_loss`` on log-probs computed by the SP runner (created on first use, when the
    model is wrapped for data parallelism)."""

    def __init__(self, plugin: ContextParallelPlugin):
        self.plugin = plugin
        self.runner = None

    def __call__(self, trainer, model, inputs: dict) -> torch.Tensor:
        if self.runner is None:
            self.runner = prepare_context_parallel(trainer.accelerator, model, self.plugin)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        completion = inputs["completion_ids"].size(1)

        def loss_fn(token_logps: torch.Tensor) -> torch.Tensor:  # [B, L]: log p(input_ids[b, t])
            return trainer.compute_loss_from_logps(model, inputs, token_logps[:, -completion:])

        result = self.runner.forward_backward(input_ids, attention_mask, loss_fn)
        return result.loss.detach().clone().requires_grad_(True)


class LocalCollectives:
    """An accelerator whose metric collectives (gather, reduce) act on this process only: the trainer uses it
    while only the owner rank of an SP micro-batch computes its loss."""

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @staticmethod
    def gather(tensor):
        return tensor if tensor.dim() else tensor[None]

    gather_for_metrics = gather

    @staticmethod
    def reduce(tensor, reduction="sum", scale=1.0):
        return tensor * scale
