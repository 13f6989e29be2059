"""Per-token log-probs (and entropies) through ``gptoss_kernels.selective_logprobs``: the one head of the loss pass.

Nothing projects all positions through ``lm_head``: the backbone gives hidden states ``[..., H]`` and
``selective_logprobs`` turns the labelled ones into ``log p`` (and ``H``) one ``[chunk, V]`` tile at a time,
recomputing each tile in backward. For token t with hidden ``h_t``, label ``y_t`` and temperature ``T``::

    z_t = (h_t @ W.T + b) / T,    logp_t = z_t[y_t] - logsumexp(z_t),    H_t = -sum_v p_tv log p_tv

``HeadConfig`` holds (and checks) what the head computes, ``output_head`` the one check of ``lm_head`` and
``token_values`` the computation. Two callers use them: the sequence-parallel runner on one shard
(``token_values_forward`` below) and the trainer's loss pass at ``sp_size=1``
(``trl_gptoss.trainer.logprob_head``, which serves TRL's fused-head contract with them).

In the runner both halves run as the modules' own forwards (swapped on the bare ``*ForCausalLM`` and on its
``lm_head`` for the duration of one call), so every wrapper's hooks run as for any forward: DDP prepares its
reducer; FSDP2 all-gathers the root's parameters and ``lm_head``'s (its own unit under accelerate's preparation)
before the projection, gathers them again before its backward and reduce-scatters their gradients; PEFT's
wrapper passes the call through.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import types
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from gptoss_kernels import selective_logprobs
from trl_gptoss.parallel.batching import IGNORE_INDEX
from trl_gptoss.parallel.truncation import truncated_log_mass


@dataclass(frozen=True)
class HeadConfig:
    """How the head turns hidden states into per-token values (for the SP runner and the trainer alike).

    ``temperature``: logits are divided by it (TRL's ``temperature``). ``entropy``: also return the entropy of
    the tempered distribution; ``entropy_grad``: the entropies carry gradient (an entropy bonus; implies
    ``entropy``). ``chunk_size``: token rows per ``[chunk, V]`` fp32 tile (None: ``selective_logprobs``'s
    default, ~256 MiB per tile). ``cast_to_fp32``: the labelled hidden states, ``lm_head``'s weight and bias
    enter the op as fp32 (TRL's ``cast_lm_head_to_fp32``); their gradients return in each input's dtype.
    ``top_k`` (> 0) / ``top_p`` (< 1): the engine sampled from that support only; the log-probs are then those of
    the truncated distribution it sampled from (``truncation.truncated_log_mass``), the entropies stay those of
    the full tempered distribution.
    """

    temperature: float = 1.0
    entropy: bool = False
    entropy_grad: bool = False
    chunk_size: int | None = None
    cast_to_fp32: bool = False
    top_k: int = -1
    top_p: float = 1.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature must be a positive finite number, got {t!r}")
        size = self.chunk_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {size!r}")
        if not isinstance(self.cast_to_fp32, bool):
            raise ValueError(f"cast_to_fp32 must be a bool, got {self.cast_to_fp32!r}")
        if self.entropy_grad and not self.entropy:
            object.__setattr__(self, "entropy", True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1: off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")


def bare_causal_lm(module):
    """The ``*ForCausalLM`` inside a PEFT wrapper (``module`` itself otherwise)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def _is_plain_linear(head) -> bool:
    """An ``nn.Linear`` itself, or one FSDP2 sharded (``fully_shard`` swaps its class for ``FSDPLinear``)."""
    cls = type(head)
    return cls is torch.nn.Linear or cls.__bases__ == (FSDPModule, torch.nn.Linear)


def output_head(model) -> torch.nn.Linear:
    """The output projection of the bare ``*ForCausalLM``; the one check of ``lm_head`` for every caller of
    ``token_values``. Refuses anything but a plain ``nn.Linear`` (FSDP2's ``FSDPLinear`` is one): the op
    projects with the weight and bias alone, so a PEFT adapter on ``lm_head`` (or any subclass adding terms)
    would be silently left out."""
    head = model.get_output_embeddings()
    if not _is_plain_linear(head):
        raise ValueError(
            "selective_logprobs projects with lm_head's weight and bias alone (an adapter's terms would be left "
            f"out), but lm_head is a {type(head).__module__}.{type(head).__qualname__}; "
            "leave lm_head out of the adapter targets (LoRA target_modules, modules_to_save) "
            "or use logprobs_implementation='trl' with sp_size=1"
        )
    return head


def _full(tensor):
    """An FSDP2 DTensor parameter (e.g. a root-sharded ``lm_head`` read outside its unit's forward) as a plain
    tensor, gathered differentiably; others unchanged."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def token_values(hidden, weight, bias, labels, config: HeadConfig):
    """``hidden [..., H]``, ``labels [...]`` (-100: none) -> ``(logp [...], entropy [...] | None)``, 0 where
    ignored; ``weight [V, H]`` and ``bias [V] | None`` are ``lm_head``'s (see ``output_head``).

    Only labelled rows reach ``selective_logprobs``; ``masked_scatter`` keeps an all-ignored shard or
    micro-batch connected to the graph (a differentiable zero), so every rank runs the same backward collectives.
    """
    keep = labels != IGNORE_INDEX
    selected, weight, bias = hidden[keep], _full(weight), None if bias is None else _full(bias)
    if config.cast_to_fp32:
        selected, weight = selected.float(), weight.float()
        bias = None if bias is None else bias.float()
    out = selective_logprobs(
        selected,
        weight,
        labels[keep],
        bias=bias,
        temperature=config.temperature,
        return_entropy=config.entropy,
        chunk_size=config.chunk_size,
    )
    logp, entropy = out if config.entropy else (out, None)
    if config.truncates:  # the engine sampled from the top-k / top-p support: score that distribution
        mass = truncated_log_mass(
            selected, weight, bias, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
        )
        logp = logp - mass.to(logp.dtype)
    logp = logp.new_zeros(keep.shape).masked_scatter(keep, logp)
    if entropy is not None:
        entropy = entropy.new_zeros(keep.shape).masked_scatter(keep, entropy)
    return logp, entropy


def _head_forward(self, hidden, *, token_labels, head_config):
    """``lm_head``'s swapped-in ``forward``: ``hidden [t, H]`` -> ``token_values`` with its own parameters."""
    return token_values(hidden, self.weight, self.bias, token_labels, head_config)


def _token_forward(self, input_ids=None, position_ids=None, *, token_labels, head_config, **unused):
    """The model's swapped-in ``forward``: backbone, then ``lm_head`` (its hooks run) on this rank's shard."""
    extra = sorted(k for k, v in unused.items() if v is not None)
    if extra:  # PEFT's wrapper passes its own keywords as None; anything set would be silently dropped
        raise ValueError(f"the sequence-parallel forward takes no {extra}")
    hidden = self.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    return self.get_output_embeddings()(hidden[0], token_labels=token_labels, head_config=head_config)


@contextlib.contextmanager
def _swapped_forward(module, forward):
    had_own = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = types.MethodType(forward, module)
    try:
        yield
    finally:
        if had_own:
            module.forward = previous
        else:
            del module.forward


@contextlib.contextmanager
def token_values_forward(module):
    """Within the block, ``model(input_ids=, position_ids=, token_labels=, head_config=)`` returns
    ``token_values`` of the shard instead of logits; ``module`` is the unwrapped model (DDP/FSDP2 wrappers
    removed, PEFT's kept)."""
    bare = bare_causal_lm(module)
    with _swapped_forward(bare, _token_forward), _swapped_forward(output_head(bare), _head_forward):
        yield
