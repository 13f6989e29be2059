"""Sequential (sort-once, one contiguous slice per expert) GPT-OSS experts with a hand-written backward.

Math, for a token ``t`` routed to experts ``e_1..e_K`` with routing weights ``w_1..w_K``::

    gu        = x_t @ W1[e] + b1[e]                        W1: [E, H, 2I] (gate/up interleaved), b1: [E, 2I]
    h         = swiglu_clamped(gu)                         [I]   (see ``swiglu.py``)
    y         = h @ W2[e] + b2[e]                          W2: [E, I, H], b2: [E, H]
    out_t     = sum_k w_k * y_k                            [H]

Layers (STYLE.md #1): ``swiglu.py`` (elementwise math) → ``_experts_forward``/``_experts_backward`` (loops
over expert slices, allocate outputs) → ``SequentialExpertsFunction`` (saves tensors, calls the loops) →
``sequential_experts`` (public, validates once).

Why a custom backward: autograd through a per-expert loop materialises a full ``[E, H, 2I]`` gradient for
every ``W1[e]`` index and a full ``[T, H]`` gradient for every token gather, i.e. work that grows with E x T.
Here the weight gradients are written slice by slice into one buffer, and the only activation saved for
backward is the ``[T*K, 2I]`` gate/up pre-activation. Eval (no grad) saves nothing and clamps each slice's
pre-activations in place.

Precision: the gate math runs in fp32 for half inputs; the output accumulates in the input dtype, as upstream's
loop does (an fp32 buffer would double eval's output memory); ``d_hidden`` accumulates in fp32.
"""

from __future__ import annotations

import torch

from gptoss_kernels.experts.params import ExpertParams, check_experts_inputs
from gptoss_kernels.experts.plan import ExpertPlan, build_expert_plan
from gptoss_kernels.experts.swiglu import (
    math_dtype_for,
    swiglu_clamped,
    swiglu_clamped_consuming,
    swiglu_clamped_with_grad,
)


def _experts_forward(hidden, weights_sorted, plan: ExpertPlan, params: ExpertParams, alpha, limit, save_gate_up):
    """Run every expert on its contiguous slice of the sorted (token, k) pairs.

    hidden: [T, H]; weights_sorted: [S] routing weights in plan order (S = T*K).
    Returns ``out: [T, H]`` and, when ``save_gate_up``, the pre-activations ``[S, 2I]`` in plan order.
    """
    w1, b1, w2, b2 = params
    # Accumulate in the output dtype like upstream: an fp32 buffer for half inputs would cost 2x the output
    # (3x with the final cast) in eval. Each index_add_ call has distinct token rows (top-k experts are
    # distinct), so it is deterministic on CUDA too.
    out = torch.zeros_like(hidden)
    gate_up_all = hidden.new_empty(plan.num_pairs, w1.shape[-1]) if save_gate_up else None
    math_dtype = math_dtype_for(hidden.dtype)
    for expert, start, end in plan.segments:
        tokens = plan.token_of_pair[start:end]
        slot = None if gate_up_all is None else gate_up_all[start:end]  # write the saved activation in place
        # mm + add_ rather than addmm: oneDNN caches a primitive per (shape, post-op) and the fused-bias ones
        # measurably grow the cold-start RSS on CPU.
        gate_up = torch.mm(hidden.index_select(0, tokens), w1[expert], out=slot).add_(b1[expert])
        if gate_up_all is None:  # eval: nothing keeps the pre-activations, clamp them in place
            h = swiglu_clamped_consuming(gate_up, alpha, limit)
        else:
            h = swiglu_clamped(gate_up, alpha, limit, math_dtype).to(hidden.dtype)
        del gate_up  # frees the slice's pre-activations (eval) before the down projection allocates
        expert_out = torch.mm(h, w2[expert]).add_(b2[expert])
        del h
        out.index_add_(0, tokens, expert_out.mul_(weights_sorted[start:end, None]))
    return out, gate_up_all


def _accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``out = a @ b`` on an expert's first chunk (no read of stale memory), ``out += a @ b`` after."""
    if first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


def _accumulate_bias_grad(grad: torch.Tensor | None, expert: int, rows: torch.Tensor, first: bool) -> None:
    """``grad[expert] = rows.sum(0)`` on the expert's first chunk, ``+=`` after; nothing for a frozen bias."""
    if grad is None:
        return
    if first:
        torch.sum(rows, 0, out=grad[expert])
    else:
        grad[expert] += rows.sum(0)


def _experts_backward(grad_out, hidden, weights_sorted, gate_up_all, plan: ExpertPlan, params, alpha, limit, needs):
    """Gradients of ``_experts_forward``: ``(d_hidden [T, H], d_weights_sorted [S], ExpertParams of grads)``.

    Per slice (g = dL/dout gathered for the slice, w = routing weights, h = swiglu(gate_up)):
    ``gW = g W2^T``; ``dL/dw = rowsum(gW * h) + g . b2`` (equals ``<g, y>`` without recomputing y);
    ``dy = w g``; ``dW2 += h^T dy``; ``db2 += sum dy``; ``dgu = swiglu'(gate_up, w gW)``;
    ``dW1 += x^T dgu``; ``db1 += sum dgu``; ``d_hidden[tokens] += dgu W1^T``.
    Weight gradients start uninitialised: each expert's first chunk overwrites its slice, experts without
    tokens are zeroed at the end (no full-size memset per call). ``needs`` (4 bools, one per parameter)
    skips the gradients of frozen parameters (e.g. LoRA elsewhere): ``None`` is returned for them.
    """
    w1, _, w2, b2 = params
    math_dtype = math_dtype_for(hidden.dtype)
    grad_out = grad_out.contiguous()
    d_hidden = torch.zeros(hidden.shape, dtype=math_dtype, device=hidden.device)
    d_weights = weights_sorted.new_empty(plan.num_pairs)
    grads = ExpertParams(*(torch.empty_like(p) if need else None for p, need in zip(params, needs)))
    seen = set()
    for expert, start, end in plan.segments:
        first = expert not in seen
        seen.add(expert)
        tokens = plan.token_of_pair[start:end]
        weight = weights_sorted[start:end, None]
        grad_y = grad_out.index_select(0, tokens)
        grad_times_w2 = (grad_y @ w2[expert].T).to(math_dtype)
        grad_h = grad_times_w2 * weight.to(math_dtype)
        h, d_gate_up = swiglu_clamped_with_grad(gate_up_all[start:end], grad_h, alpha, limit)
        d_weights[start:end] = grad_times_w2.mul_(h).sum(-1).add_((grad_y @ b2[expert]).to(math_dtype))
        grad_y_scaled = grad_y * weight
        if grads.down_proj is not None:
            _accumulate_mm(grads.down_proj[expert], h.to(hidden.dtype).T, grad_y_scaled, first)
        if grads.gate_up_proj is not None:
            _accumulate_mm(grads.gate_up_proj[expert], hidden.index_select(0, tokens).T, d_gate_up, first)
        _accumulate_bias_grad(grads.down_proj_bias, expert, grad_y_scaled, first)
        _accumulate_bias_grad(grads.gate_up_proj_bias, expert, d_gate_up, first)
        d_hidden.index_add_(0, tokens, (d_gate_up @ w1[expert].T).to(math_dtype))
    for expert in set(range(params.num_experts)) - seen:
        for grad in grads:
            if grad is not None:
                grad[expert].zero_()
    return d_hidden.to(hidden.dtype), d_weights, grads


class SequentialExpertsFunction(torch.autograd.Function):
    """Autograd wrapper: saves ``hidden``, routing weights, expert parameters and the ``[S, 2I]`` pre-activations.

    ``apply(hidden, routing_weights, plan, alpha, limit, save, *params)``: the four parameters come last, as
    separate tensors, so autograd tracks each of them.
    """

    @staticmethod
    def forward(ctx, hidden, routing_weights, plan, alpha, limit, save, *param_tensors):
        params = ExpertParams(*param_tensors)
        weights_sorted = routing_weights.reshape(-1).index_select(0, plan.order)
        out, gate_up_all = _experts_forward(hidden, weights_sorted, plan, params, alpha, limit, save)
        ctx.plan, ctx.alpha, ctx.limit, ctx.weights_shape = plan, alpha, limit, routing_weights.shape
        if save:
            ctx.save_for_backward(hidden, weights_sorted, gate_up_all, *params)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        hidden, weights_sorted, gate_up_all, *param_tensors = ctx.saved_tensors
        params, needs = ExpertParams(*param_tensors), ctx.needs_input_grad[6:]
        d_hidden, d_weights_sorted, d_params = _experts_backward(
            grad_out, hidden, weights_sorted, gate_up_all, ctx.plan, params, ctx.alpha, ctx.limit, needs
        )
        d_weights = torch.empty_like(d_weights_sorted).index_copy_(0, ctx.plan.order, d_weights_sorted)
        d_weights = d_weights.reshape(ctx.weights_shape).to(weights_sorted.dtype)
        return d_hidden, d_weights, None, None, None, None, *d_params


def sequential_experts(
    hidden_states: torch.Tensor,
    router_indices: torch.Tensor,
    routing_weights: torch.Tensor,
    params: ExpertParams,
    *,
    alpha: float,
    limit: float,
    rows_per_chunk: int | None = None,
    layer_name: str = "experts",
) -> torch.Tensor:
    """GPT-OSS mixture of experts, one contiguous token slice per expert, identical in train and eval.

    Args:
        hidden_states: ``[T, H]``. router_indices: integer ``[T, K]`` in ``[0, E)``, distinct per row.
            routing_weights: finite ``[T, K]``, same dtype as ``hidden_states``. params: ``ExpertParams``
            (``gate_up_proj [E, H, 2I]`` interleaved, ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``,
            ``down_proj_bias [E, H]``).
        alpha, limit: GPT-OSS ``swiglu_alpha`` / ``swiglu_limit``.
        rows_per_chunk: at most this many (token, expert) rows per matmul (bounds the eval peak when routing
            is skewed); ``None`` = one matmul per expert.
        layer_name: prefixes error messages.
    Returns ``[T, H]``, differentiable in hidden_states, routing_weights and all four expert parameters.
    Peak extra memory: ``[T, H]`` output + ``[T*K]`` indices + one slice's gathered input and pre-activations
    (eval); training adds the saved ``[T*K, 2I]`` pre-activations. No tensor ever has E x T x H elements.
    Raises ``ValueError`` naming ``layer_name`` and the argument for any bad shape, dtype, device, index out
    of range or non-finite routing weight (one host sync per call, for the per-expert counts).
    """
    check_experts_inputs(hidden_states, router_indices, routing_weights, params, rows_per_chunk, layer_name)
    plan = build_expert_plan(
        router_indices, routing_weights, params.num_experts, rows_per_chunk=rows_per_chunk, layer_name=layer_name
    )
    tensors = (hidden_states, routing_weights, *params)
    # Inside Function.forward grad mode is off, so decide here whether backward will run (eval saves nothing).
    save_for_backward = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return SequentialExpertsFunction.apply(
        hidden_states, routing_weights, plan, float(alpha), float(limit), save_for_backward, *params
    )
