"""Shared builders for the long-context tests: a tiny GPT-OSS with ``fa3_sink`` + ``gptoss_sequential``, one
training step's logits and every gradient, and the error yardstick of the plain fp32 path against float64."""

from __future__ import annotations

import copy

import torch

import trl_gptoss  # noqa: F401  (registers fa3_sink / gptoss_sequential)
from trl_gptoss.long_context import enable_long_context
from trl_gptoss.testing import tiny_gpt_oss

NUM_LAYERS = 4
BATCH, SEQ = 2, 23  # 46 tokens: 23 is prime, so tiles of 7 cross the batch rows


def tiny_model(*, lora: bool = False) -> torch.nn.Module:
    """4 layers (sliding and full attention), fp32, train mode; with ``lora``: PEFT adapters on attention and
    both expert parameters, initialised non-zero so every adapter matrix gets a gradient."""
    model = tiny_gpt_oss(attn_implementation="fa3_sink", num_hidden_layers=NUM_LAYERS)
    model.set_experts_implementation("gptoss_sequential")
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            init_lora_weights=False,
        )
        model = get_peft_model(model, config)
    return model.train()


def token_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def step(model, ids, *, checkpointing=True, token_tile=None, offload=False, reentrant=False):
    """``(logits, loss, {name: grad})`` of one forward + backward of a copy of ``model`` with the options on,
    and the copy's long-context handle (its ``offload`` counters). ``reentrant``: torch's reentrant checkpoint
    (what TRL forces for PEFT under DeepSpeed) instead of transformers' default."""
    model = copy.deepcopy(model)
    handle = enable_long_context(model, token_tile=token_tile, offload_checkpoints=offload)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if reentrant:  # its recompute only runs backward for inputs that require grad
            model.enable_input_require_grads()
    logits = model(input_ids=ids).logits
    loss = logits.double().log_softmax(-1).mean()  # a loss that reaches every logit
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads, handle


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    scale = expected.double().abs().max().item()
    return (actual.double() - expected.double()).abs().max().item() / (scale or 1.0)
