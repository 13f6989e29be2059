"""Per-token log-probs (and entropies) of one sequence shard through ``gptoss_kernels.selective_logprobs``.

The sharded loss pass never projects all positions through ``lm_head``: the backbone gives this rank's hidden
states ``[T/n, H]`` and ``selective_logprobs`` turns the labelled ones into ``log p`` (and ``H``) one
``[chunk, V]`` tile at a time, recomputing each tile in backward. For token t with hidden ``h_t``, label
``y_t`` and temperature ``T``::

    z_t = (h_t @ W.T + b) / T,    logp_t = z_t[y_t] - logsumexp(z_t),    H_t = -sum_v p_tv log p_tv

Both halves run as the modules' own forwards (swapped on the bare ``*ForCausalLM`` and on its ``lm_head`` for
the duration of one call), so every wrapper's hooks run as for any forward: DDP prepares its reducer; FSDP2
all-gathers the root's parameters and ``lm_head``'s (its own unit under accelerate's preparation) before the
projection, gathers them again before its backward and reduce-scatters their gradients; PEFT's wrapper passes
the call through.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import types
from dataclasses import dataclass

import torch

from gptoss_kernels import selective_logprobs
from trl_gptoss.parallel.batching import IGNORE_INDEX


@dataclass(frozen=True)
class HeadConfig:
    """How the runner turns hidden states into per-token values.

    ``temperature``: logits are divided by it (TRL's ``temperature``). ``entropy``: also return the entropy of
    the tempered distribution; ``entropy_grad``: the entropies carry gradient (an entropy bonus; implies
    ``entropy``). ``chunk_size``: token rows per ``[chunk, V]`` fp32 tile (None: ``selective_logprobs``'s
    default, ~256 MiB per tile).
    """

    temperature: float = 1.0
    entropy: bool = False
    entropy_grad: bool = False
    chunk_size: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature must be a positive finite number, got {t!r}")
        size = self.chunk_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {size!r}")
        if self.entropy_grad and not self.entropy:
            object.__setattr__(self, "entropy", True)


def bare_causal_lm(module):
    """The ``*ForCausalLM`` inside a PEFT wrapper (``module`` itself otherwise)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def output_head(model) -> torch.nn.Linear:
    """The output projection; refuses heads that are not an ``nn.Linear`` (FSDP2's ``FSDPLinear`` is one; a PEFT
    adapter on ``lm_head`` is not, and running its base weight alone would silently skip the adapter)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"sequence parallelism reads lm_head's weight directly, but lm_head is a "
            f"{type(head).__module__}.{type(head).__qualname__}; "
            "leave lm_head out of the adapter targets (LoRA target_modules, modules_to_save) or use sp_size=1"
        )
    return head


def token_values(hidden, weight, bias, labels, config: HeadConfig):
    """``hidden [t, H]``, ``labels [t]`` (-100: none) -> ``(logp [t], entropy [t] | None)``, 0 where ignored.

    Only labelled rows reach ``selective_logprobs``; ``masked_scatter`` keeps an all-ignored shard connected to
    the graph (a differentiable zero), so every rank of the group runs the same backward collectives.
    """
    keep = labels != IGNORE_INDEX
    out = selective_logprobs(
        hidden[keep],
        weight,
        labels[keep],
        bias=bias,
        temperature=config.temperature,
        return_entropy=config.entropy,
        chunk_size=config.chunk_size,
    )
    logp, entropy = out if config.entropy else (out, None)
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
