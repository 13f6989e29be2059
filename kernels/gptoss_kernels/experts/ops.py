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
loop does (an fp32 buffer would double eval's output memory); ``d_hidden`` accumulates in fp32. Under
``torch.autocast`` the matmuls take autocast's dtype and everything else stays in ``hidden_states``' dtype,
as for stock ``GptOssExperts`` (``precision.py``).
"""

from __future__ import annotations

import torch

from gptoss_kernels.autocast import autocast_dtype, autocast_off, without_autocast
from gptoss_kernels.experts.params import ExpertParams, check_experts_inputs
from gptoss_kernels.experts.plan import ExpertPlan, build_expert_plan
from gptoss_kernels.experts.precision import Precision, as_act, as_mm, precision_for
from gptoss_kernels.experts.swiglu import (
    swiglu_clamped,
    swiglu_clamped_consuming,
    swiglu_clamped_with_grad,
)


def _experts_forward(x, weights_sorted, plan: ExpertPlan, params: ExpertParams, alpha, limit, save, precision):
    """Run every expert on its contiguous slice of the sorted (token, k) pairs.

    x: ``[T, H]`` hidden states, in ``precision.io`` or already as matmul operand (``precision.mm``): each
    slice's gathered rows are cast, so no ``[T, H]`` copy exists here; weights_sorted: ``[S]`` routing weights
    in plan order (S = T*K), in ``precision.act``. Returns ``out: [T, H]`` (``precision.io``) and, when
    ``save``, the pre-activations ``[S, 2I]`` in plan order (``precision.act``).
    """
    w1, b1, w2, b2 = params
    # Accumulate in the output dtype like upstream: an fp32 buffer for half inputs would cost 2x the output
    # (3x with the final cast) in eval. Each index_add_ call has distinct token rows (top-k experts are
    # distinct), so it is deterministic on CUDA too.
    out = torch.zeros(x.shape, dtype=precision.io, device=x.device)
    gate_up_all = x.new_empty(plan.num_pairs, w1.shape[-1], dtype=precision.act) if save else None
    for expert, start, end in plan.segments:
        tokens = plan.token_of_pair[start:end]
        slot = None if gate_up_all is None else gate_up_all[start:end]  # write the saved activation in place
        # mm + add_ rather than addmm: oneDNN caches a primitive per (shape, post-op) and the fused-bias ones
        # measurably grow the cold-start RSS on CPU.
        x_rows = as_mm(x.index_select(0, tokens), precision)  # gather, then cast: bit-identical to cast, gather
        gate_up = _mm_in_act(x_rows, as_mm(w1[expert], precision), slot, precision)
        del x_rows
        gate_up.add_(as_act(b1[expert], precision))
        if gate_up_all is None:  # eval: nothing keeps the pre-activations, clamp them in place
            h = swiglu_clamped_consuming(gate_up, alpha, limit)
        else:
            h = swiglu_clamped(gate_up, alpha, limit, precision.math).to(precision.act)
        del gate_up  # eval: fp32 frees the pre-activations here; half types wrote h into their storage
        expert_out = _mm_in_act(as_mm(h, precision), as_mm(w2[expert], precision), None, precision)
        del h
        expert_out.add_(as_act(b2[expert], precision))
        out.index_add_(0, tokens, expert_out.mul_(weights_sorted[start:end, None]).to(precision.io))
    return out, gate_up_all


def _mm_in_act(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, precision: Precision) -> torch.Tensor:
    """``a @ b`` in ``precision.act``, written into ``out`` when given. Under autocast the product is taken in the
    lowered dtype and then widened, as stock's ``x @ W[e] + b[e]`` promotes it before the bias add."""
    if not precision.autocast:
        return torch.mm(a, b, out=out)
    product = torch.mm(a, b)
    return product.to(precision.act) if out is None else out.copy_(product)


def _accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``out = a @ b`` on an expert's first chunk (no read of stale memory), ``out += a @ b`` after. ``out`` may
    be wider than ``a, b`` (an fp32 parameter's gradient of an autocast matmul): the product is widened."""
    if out.dtype != a.dtype:
        product = torch.mm(a, b)
        out.copy_(product) if first else out.add_(product)
    elif first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


def _accumulate_bias_grad(grad: torch.Tensor | None, expert: int, rows: torch.Tensor, first: bool) -> None:
    """``grad[expert] = rows.sum(0)`` on the expert's first chunk, ``+=`` after; nothing for a frozen bias."""
    if grad is None:
        return
    if first and grad.dtype == rows.dtype:
        torch.sum(rows, 0, out=grad[expert])
    elif first:
        grad[expert].copy_(rows.sum(0))
    else:
        grad[expert] += rows.sum(0)


def _experts_backward(
    grad_out, x_mm, weights_sorted, gate_up_all, plan: ExpertPlan, params, alpha, limit, needs, precision
):
    """Gradients of ``_experts_forward``: ``(d_hidden [T, H], d_weights_sorted [S], ExpertParams of grads)``.

    Per slice (g = dL/dout gathered for the slice, w = routing weights, h = swiglu(gate_up)):
    ``gW = g W2^T``; ``dL/dw = rowsum(gW * h) + g . b2`` (equals ``<g, y>`` without recomputing y);
    ``dy = w g``; ``dW2 += h^T dy``; ``db2 += sum dy``; ``dgu = swiglu'(gate_up, w gW)``;
    ``dW1 += x^T dgu``; ``db1 += sum dgu``; ``d_hidden[tokens] += dgu W1^T``.
    The matmuls take their operands in ``precision.mm`` as the forward's did (autocast's backward does the
    same); each parameter's gradient has the parameter's dtype, ``d_hidden`` ``precision.io``, ``dL/dw``
    ``precision.act``.
    Weight gradients start uninitialised: each expert's first chunk overwrites its slice, experts without
    tokens are zeroed at the end (no full-size memset per call). ``needs`` (4 bools, one per parameter)
    skips the gradients of frozen parameters (e.g. LoRA elsewhere): ``None`` is returned for them.
    """
    w1, _, w2, b2 = params
    math_dtype = precision.math
    grad_out = grad_out.contiguous().to(precision.act)
    d_hidden = torch.zeros(x_mm.shape, dtype=math_dtype, device=x_mm.device)
    d_weights = weights_sorted.new_empty(plan.num_pairs)
    grads = ExpertParams(*(torch.empty_like(p) if need else None for p, need in zip(params, needs)))
    seen = set()
    for expert, start, end in plan.segments:
        first = expert not in seen
        seen.add(expert)
        tokens = plan.token_of_pair[start:end]
        weight = weights_sorted[start:end, None]
        grad_y = grad_out.index_select(0, tokens)
        grad_times_w2 = (as_mm(grad_y, precision) @ as_mm(w2[expert], precision).T).to(math_dtype)
        grad_h = grad_times_w2 * weight.to(math_dtype)
        h, d_gate_up = swiglu_clamped_with_grad(gate_up_all[start:end], grad_h, alpha, limit)
        b2_term = grad_y @ as_act(b2[expert], precision)
        d_weights[start:end] = grad_times_w2.mul_(h).sum(-1).add_(b2_term.to(math_dtype))
        grad_y_scaled = grad_y * weight
        d_gate_up_mm = as_mm(d_gate_up, precision)
        if grads.down_proj is not None:
            _accumulate_mm(grads.down_proj[expert], h.to(precision.mm).T, as_mm(grad_y_scaled, precision), first)
        if grads.gate_up_proj is not None:
            _accumulate_mm(grads.gate_up_proj[expert], x_mm.index_select(0, tokens).T, d_gate_up_mm, first)
        _accumulate_bias_grad(grads.down_proj_bias, expert, grad_y_scaled, first)
        _accumulate_bias_grad(grads.gate_up_proj_bias, expert, d_gate_up, first)
        d_hidden.index_add_(0, tokens, (d_gate_up_mm @ as_mm(w1[expert], precision).T).to(math_dtype))
    for expert in set(range(params.num_experts)) - seen:
        for grad in grads:
            if grad is not None:
                grad[expert].zero_()
    return d_hidden.to(precision.io), d_weights, grads


class SequentialExpertsFunction(torch.autograd.Function):
    """Autograd wrapper: saves the hidden states (as matmul operand), routing weights, expert parameters and the
    ``[S, 2I]`` pre-activations.

    ``apply(hidden, routing_weights, plan, precision, alpha, limit, save, *params)``: the four parameters come
    last, as separate tensors, so autograd tracks each of them. Called with autocast off: ``precision`` says
    which dtype every part runs in.
    """

    @staticmethod
    def forward(ctx, hidden, routing_weights, plan, precision, alpha, limit, save, *param_tensors):
        params = ExpertParams(*param_tensors)
        # Training keeps the matmul operand for backward's dW1 (under autocast a lowered [T, H] copy, half the
        # bytes of the fp32 input). Eval must not make that copy: it lives for the whole call, T*H*2 bytes
        # beside the [T, H] output, which put the eval peak above a plain per-expert loop's under autocast;
        # there each slice's gathered rows are cast instead.
        x_mm = as_mm(hidden, precision) if save else hidden
        weights_sorted = as_act(routing_weights.reshape(-1).index_select(0, plan.order), precision)
        out, gate_up_all = _experts_forward(x_mm, weights_sorted, plan, params, alpha, limit, save, precision)
        ctx.plan, ctx.precision, ctx.alpha, ctx.limit = plan, precision, alpha, limit
        ctx.weights_shape, ctx.weights_dtype = routing_weights.shape, routing_weights.dtype
        if save:
            ctx.save_for_backward(x_mm, weights_sorted, gate_up_all, *params)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast  # a backward called inside autocast: the casts are precision's, not autocast's
    def backward(ctx, grad_out):
        x_mm, weights_sorted, gate_up_all, *param_tensors = ctx.saved_tensors
        params, needs = ExpertParams(*param_tensors), ctx.needs_input_grad[7:]
        d_hidden, d_weights_sorted, d_params = _experts_backward(
            grad_out,
            x_mm,
            weights_sorted,
            gate_up_all,
            ctx.plan,
            params,
            ctx.alpha,
            ctx.limit,
            needs,
            ctx.precision,
        )
        d_weights = torch.empty_like(d_weights_sorted).index_copy_(0, ctx.plan.order, d_weights_sorted)
        d_weights = d_weights.reshape(ctx.weights_shape).to(ctx.weights_dtype)
        return d_hidden, d_weights, None, None, None, None, None, *d_params


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
            routing_weights: finite ``[T, K]``, same dtype as ``hidden_states`` (any float dtype under
            ``torch.autocast``, like the parameters). params: ``ExpertParams``
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
    precision = precision_for(hidden_states)
    autocast = autocast_dtype(hidden_states.device) is not None
    check_experts_inputs(
        hidden_states, router_indices, routing_weights, params, rows_per_chunk, layer_name, autocast=autocast
    )
    plan = build_expert_plan(
        router_indices, routing_weights, params.num_experts, rows_per_chunk=rows_per_chunk, layer_name=layer_name
    )
    tensors = (hidden_states, routing_weights, *params)
    # Inside Function.forward grad mode is off, so decide here whether backward will run (eval saves nothing).
    save_for_backward = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    with autocast_off(hidden_states.device):  # precision already holds autocast's choice
        return SequentialExpertsFunction.apply(
            hidden_states, routing_weights, plan, precision, float(alpha), float(limit), save_for_backward, *params
        )
