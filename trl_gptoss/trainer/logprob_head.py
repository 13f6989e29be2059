"""The loss pass's log-probs through ``gptoss_kernels.selective_logprobs``: no ``[tokens, vocab]`` logits.

TRL 1.16 patches the policy's ``forward`` so that ``model(..., labels=labels, fused_lm_head=True)`` returns
per-token log-probs and entropies; its head projects up to 32,768 positions at once, i.e. the whole
``[N, 201,088]`` fp32 logits of a GPT-OSS completion (13 GB at 16k tokens). ``add_selective_logprobs_head``
replaces that patch with the same contract served by ``selective_logprobs``, which keeps one chunk of logits
at a time and recomputes it in backward. The call still goes through ``model(...)``, so DDP, FSDP2 and PEFT
wrappers run their hooks as for any forward; only the positions whose label is not -100 are projected.
"""

from __future__ import annotations

import functools
import types

import torch
from trl.trainer.utils import FusedCausalLMOutput

from gptoss_kernels import selective_logprobs

LOGPROBS_IMPLEMENTATIONS = ("selective_logprobs", "trl")


def _full(tensor):
    """An FSDP2 DTensor parameter (root-sharded ``lm_head``) as a plain tensor; others unchanged."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _aux_loss(model, backbone_outputs, attention_mask):
    """The MoE load-balancing loss the model's own forward adds (GPT-OSS: Mixtral's formula)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = model.config.get_text_config()
    return load_balancing_loss_func(
        backbone_outputs.router_logits, config.num_local_experts, config.num_experts_per_tok, attention_mask
    )


def add_selective_logprobs_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False) -> None:
    """Serve ``model(..., labels=labels, fused_lm_head=True)`` with ``selective_logprobs`` (log-probs and
    entropies of the tempered distribution at every position whose next-token label is not -100, 0 elsewhere).

    Call on the bare model (under PEFT: ``get_base_model()``) after TRL's own patch; other calls (generation,
    plain forwards) go to the forward it replaces. Returns nothing; the model is patched in place. A PEFT
    adapter on ``lm_head`` is refused: the op reads the head's weight, which would silently leave it out.
    """
    check_plain_head(model)
    fallback = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kw):
        if not fused_lm_head:
            return fallback(
                *args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch, **kw
            )
        return _selective_forward(self, temperature, cast_lm_head_to_fp32, args, labels, shift_labels, kw)

    model.forward = types.MethodType(forward, model)


def check_plain_head(model) -> None:
    """``lm_head`` must be a plain linear layer (its ``weight`` is all the projection there is)."""
    head = model.get_output_embeddings()
    if hasattr(head, "base_layer") or type(head) is not torch.nn.Linear:
        raise ValueError(
            f"logprobs_implementation='selective_logprobs' projects with lm_head's weight, but lm_head is a "
            f"{type(head).__module__}.{type(head).__name__} (a PEFT adapter?) whose extra terms it would leave out; "
            "drop lm_head from the adapter's target_modules or set logprobs_implementation='trl'"
        )


def _selective_forward(model, temperature, cast_lm_head_to_fp32, args, labels, shift_labels, kwargs):
    config = model.config.get_text_config()
    kwargs["use_cache"] = False
    if getattr(config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    backbone = model.base_model(*args, **kwargs)
    hidden = backbone.last_hidden_state
    if shift_labels is None:  # position t predicts label t + 1
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    head = model.get_output_embeddings()
    weight, bias = _full(head.weight), None if head.bias is None else _full(head.bias)
    mask = labels != -100
    selected = hidden[mask]
    if cast_lm_head_to_fp32:
        selected, weight = selected.float(), weight.float()
        bias = None if bias is None else bias.float()
    log_probs, entropy = selective_logprobs(
        selected, weight, labels[mask], bias=bias, temperature=temperature, return_entropy=True
    )
    # masked_scatter keeps an all-masked micro-batch connected to the graph (a differentiable zero)
    log_probs = log_probs.new_zeros(mask.shape).masked_scatter(mask, log_probs)
    entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
    aux_loss = _aux_loss(model, backbone, kwargs.get("attention_mask")) if kwargs.get("output_router_logits") else None
    loss = -log_probs.sum() / mask.sum().clamp(min=1)
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask, aux_loss=aux_loss)
