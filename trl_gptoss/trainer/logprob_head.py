"""TRL's fused log-prob head served by the one head of ``trl_gptoss.parallel.head``: no ``[tokens, vocab]`` logits.

TRL 1.16 patches the policy's ``forward`` so that ``model(..., labels=labels, fused_lm_head=True)`` returns
per-token log-probs and entropies; its head projects up to 32,768 positions at once, i.e. the whole
``[N, 201,088]`` fp32 logits of a GPT-OSS completion (13 GB at 16k tokens). ``add_selective_logprobs_head``
replaces that patch with the same contract served by ``token_values`` (``selective_logprobs``, one chunk of
logits at a time, recomputed in backward), the head the sequence-parallel runner uses too. This module only
adapts it to TRL's call: label shift, the MoE aux loss and ``FusedCausalLMOutput``. The call still goes through
``model(...)``, so DDP, FSDP2 and PEFT wrappers run their hooks as for any forward; only the positions whose
label is not -100 are projected.
"""

from __future__ import annotations

import functools
import types

from trl.trainer.utils import FusedCausalLMOutput

from trl_gptoss.parallel.batching import IGNORE_INDEX
from trl_gptoss.parallel.head import HeadConfig, output_head, token_values
from trl_gptoss.rollout.weights.names import unwrap

LOGPROBS_IMPLEMENTATIONS = ("selective_logprobs", "trl")


def _aux_loss(model, backbone_outputs, attention_mask):
    """The MoE load-balancing loss the model's own forward adds (GPT-OSS: Mixtral's formula)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = model.config.get_text_config()
    return load_balancing_loss_func(
        backbone_outputs.router_logits, config.num_local_experts, config.num_experts_per_tok, attention_mask
    )


def replace_fused_heads(args, models, temperature: float) -> None:
    """With ``logprobs_implementation: selective_logprobs``, ``add_selective_logprobs_head`` on the bare model of
    each of ``models`` that is not None (the policy, the reference model): TRL's fused head was added to the bare
    model, ours replaces it there."""
    if args.logprobs_implementation != "selective_logprobs":
        return
    for model in models:
        if model is not None:
            bare, top = unwrap(model, peft=True), {"top_k": args.engine_top_k, "top_p": args.top_p}
            add_selective_logprobs_head(bare, temperature, args.cast_lm_head_to_fp32, **top)


def add_selective_logprobs_head(
    model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False, *, top_k: int = -1, top_p: float = 1.0
) -> None:
    """Serve ``model(..., labels=labels, fused_lm_head=True)`` with ``token_values`` (log-probs and entropies of
    the tempered distribution at every position whose next-token label is not -100, 0 elsewhere; the entropies
    carry gradient, as TRL's do). ``top_k`` / ``top_p``: the log-probs are those of the truncated distribution
    the engine sampled from (``HeadConfig``).

    Call on the bare model (under PEFT: ``get_base_model()``) after TRL's own patch; other calls (generation,
    plain forwards) go to the forward it replaces. Returns nothing; the model is patched in place. Refuses what
    the head refuses, before patching: a bad ``temperature`` (``HeadConfig``) and an ``lm_head`` that is not a
    plain linear layer, e.g. a PEFT adapter (``output_head``).
    """
    config = HeadConfig(
        temperature=temperature,
        entropy=True,
        entropy_grad=True,
        cast_to_fp32=cast_lm_head_to_fp32,
        top_k=top_k,
        top_p=top_p,
    )
    output_head(model)
    fallback = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kw):
        if not fused_lm_head:
            return fallback(
                *args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch, **kw
            )
        return _selective_forward(self, config, args, labels, shift_labels, kw)

    model.forward = types.MethodType(forward, model)


def _selective_forward(model, config: HeadConfig, args, labels, shift_labels, kwargs):
    text_config = model.config.get_text_config()
    kwargs["use_cache"] = False
    if getattr(text_config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    backbone = model.base_model(*args, **kwargs)
    hidden = backbone.last_hidden_state
    if shift_labels is None:  # position t predicts label t + 1
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    head = model.get_output_embeddings()
    log_probs, entropy = token_values(hidden, head.weight, head.bias, labels, config)
    mask = labels != IGNORE_INDEX
    aux_loss = _aux_loss(model, backbone, kwargs.get("attention_mask")) if kwargs.get("output_router_logits") else None
    loss = -log_probs.sum() / mask.sum().clamp(min=1)
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask, aux_loss=aux_loss)
