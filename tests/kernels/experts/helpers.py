"""Shared builders for the experts tests: a standalone upstream ``GptOssExperts`` (the reference) with random
weights, random routing, and outputs + every gradient of any experts implementation."""

from __future__ import annotations

import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from gptoss_kernels.experts import ExpertParams, sequential_experts
from trl_gptoss.testing import tiny_gpt_oss_config

WEIGHT_STD = 0.6  # large enough that some gate/up pre-activations pass the +-7 clamp
GRAD_NAMES = [
    "out",
    "d_hidden",
    "d_routing_weights",
    "d_gate_up_proj",
    "d_gate_up_proj_bias",
    "d_down_proj",
    "d_down_proj_bias",
]


def upstream_experts(num_experts=4, hidden=32, intermediate=24, *, dtype=torch.float64, seed=0) -> GptOssExperts:
    """Upstream ``GptOssExperts`` forced onto its eager loop (the reference), random weights."""
    config = tiny_gpt_oss_config(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=num_experts)
    config._experts_implementation = "eager"
    experts = GptOssExperts(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * WEIGHT_STD)
    return experts.to(dtype)


def op_of(experts: GptOssExperts, rows_per_chunk=None):
    """``sequential_experts`` on ``experts``' parameters, called like the module: ``f(hidden, index, weights)``."""

    def run(hidden, index, weights):
        params = ExpertParams.of(experts)
        kwargs = dict(alpha=experts.alpha, limit=experts.limit, rows_per_chunk=rows_per_chunk)
        return sequential_experts(hidden, index, weights, params, **kwargs)

    return run


def random_routing(num_tokens, num_experts, top_k, *, seed=0, allowed=None, dtype=torch.float64):
    """Distinct experts per token drawn from ``allowed`` (default all), softmax-normalised weights."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.arange(num_experts) if allowed is None else torch.tensor(allowed)
    rows = [allowed[torch.randperm(len(allowed), generator=generator)[:top_k]] for _ in range(num_tokens)]
    index = torch.stack(rows) if rows else torch.empty(0, top_k, dtype=torch.long)
    weights = torch.randn(num_tokens, top_k, generator=generator, dtype=torch.float64).softmax(-1)
    return index, weights.to(dtype)


def forward_and_grads(run, experts, hidden, index, weights, grad_seed=1):
    """Output of ``run(hidden, index, weights)`` and the gradients of ``<out, G>`` (fixed random ``G``) w.r.t.
    hidden, weights and ``experts``' four parameters, in ``GRAD_NAMES`` order."""
    hidden = hidden.detach().requires_grad_(True)
    weights = weights.detach().requires_grad_(True)
    out = run(hidden, index, weights)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=torch.float64)
    grads = torch.autograd.grad((out * cotangent.to(out.dtype)).sum(), [hidden, weights, *ExpertParams.of(experts)])
    return [out.detach(), *grads]


def max_rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 when both are all-zero)."""
    scale = expected.double().abs().max().item()
    diff = (actual.double() - expected.double()).abs().max().item()
    return diff / scale if scale > 0 else diff
