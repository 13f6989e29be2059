"""Sequential (sort-once, one contiguous slice per expert) GPT-OSS experts with a hand-written backward.

Math, for a token ``t`` routed to experts ``e_1..e_K`` with routing weights ``w_1..w_K``::

    gu        = x_t @ W1[e] + b1[e]                        W1: [E, H, 2I] (gate/up interleaved), b1: [E, 2I]
    gate, up  = gu[..., 0::2], gu[..., 1::2]
    g, u      = min(gate, L), clamp(up, -L, L)               L = swiglu_limit
    h         = (u + 1) * g * sigmoid(alpha * g)             [I]
    y         = h @ W2[e] + b2[e]                            W2: [E, I, H], b2: [E, H]
    out_t     = sum_k w_k * y_k                              [H]

Layers (STYLE.md #1): ``swiglu_clamped``/``swiglu_clamped_backward`` (elementwise math) →
``_experts_forward``/``_experts_backward`` (loops over expert slices, allocate outputs) →
``SequentialExpertsFunction`` (saves tensors, calls the loops) → ``sequential_experts`` (public).

Why a custom backward: autograd through a per-expert loop materialises a full ``[E, H, 2I]`` gradient for
every ``W1[e]`` index and a full ``[T, H]`` gradient for every token gather, i.e. work that grows with E x T. Here
the weight gradients are written slice by slice into one buffer, and the only activation saved for backward is the
``[T*K, 2I]`` gate/up pre-activation (grouped_mm's autograd saves the gathered input, gate/up, the gate's
intermediates and the down output as well).
"""

from __future__ import annotations

import torch

from trl_gptoss.experts.plan import ExpertPlan, build_expert_plan

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """Elementwise math and accumulation run in fp32 for half types (more accurate than the upstream loop)."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS gated activation: ``gate_up [N, 2I]`` (gate at even, up at odd columns) → ``[N, I]``."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def swiglu_clamped_backward(
    gate_up: torch.Tensor, grad_h: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    """Gradient of ``swiglu_clamped`` w.r.t. ``gate_up: [N, 2I]`` given ``grad_h: [N, I]``.

    With ``s = sigmoid(alpha*g)``: ``dh/dg = (u+1) (s + alpha g s (1-s))``, ``dh/du = g s``; the clamps pass
    the gradient where the input lies in the closed interval (torch's convention: ``gate <= L``,
    ``-L <= up <= L``).
    """
    raw_gate, raw_up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = raw_gate.clamp(max=limit)
    up = raw_up.clamp(min=-limit, max=limit)
    sig = torch.sigmoid(gate * alpha)
    d_gate = grad_h * (up + 1) * (sig + alpha * gate * sig * (1 - sig))
    d_up = grad_h * (gate * sig)
    d_gate = d_gate.masked_fill_(raw_gate > limit, 0)
    d_up = d_up.masked_fill_((raw_up < -limit) | (raw_up > limit), 0)
    # Re-interleave: [N, I, 2] viewed as [N, 2I] puts gate at even and up at odd columns.
    return torch.stack((d_gate, d_up), dim=-1).flatten(-2)


def _expert_hidden(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return swiglu_clamped(gate_up.to(_math_dtype(gate_up.dtype)), alpha, limit).to(gate_up.dtype)


def _experts_forward(hidden, weights_sorted, plan: ExpertPlan, w1, b1, w2, b2, alpha, limit, save_gate_up):
    """Run every expert on its contiguous slice of the sorted (token, k) pairs.

    hidden: [T, H]; weights_sorted: [S] routing weights in plan order (S = T*K).
    Returns ``out: [T, H]`` and, when ``save_gate_up``, the pre-activations ``[S, 2I]`` in plan order.
    """
    acc_dtype = _math_dtype(hidden.dtype)
    out = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device)
    gate_up_all = hidden.new_empty(plan.num_pairs, w1.shape[-1]) if save_gate_up else None
    for expert, start, end in plan.segments:
        tokens = plan.token_of_pair[start:end]
        gate_up = torch.addmm(b1[expert], hidden.index_select(0, tokens), w1[expert])
        if gate_up_all is not None:
            gate_up_all[start:end] = gate_up
        expert_out = torch.addmm(b2[expert], _expert_hidden(gate_up, alpha, limit), w2[expert])
        expert_out = expert_out.to(acc_dtype).mul_(weights_sorted[start:end, None].to(acc_dtype))
        out.index_add_(0, tokens, expert_out)
    return out.to(hidden.dtype), gate_up_all


def _experts_backward(
    grad_out, hidden, weights_sorted, gate_up_all, plan: ExpertPlan, w1, b1, w2, b2, alpha, limit
):
    """Gradients of ``_experts_forward``: (d_hidden [T,H], d_weights_sorted [S], dW1, db1, dW2, db2).

    Per slice (g = dL/dout gathered for the slice, w = routing weights, h = swiglu(gate_up)):
    ``gW = g W2^T``; ``dL/dw = rowsum(gW * h) + g . b2`` (equals ``<g, y>`` without recomputing y);
    ``dy = w g``; ``dW2 += h^T dy``; ``db2 += sum dy``; ``dgu = swiglu'(gate_up, w gW)``;
    ``dW1 += x^T dgu``; ``db1 += sum dgu``; ``d_hidden[tokens] += dgu W1^T``.
    """
    math_dtype = _math_dtype(hidden.dtype)
    grad_out = grad_out.contiguous()
    d_hidden = torch.zeros(hidden.shape, dtype=math_dtype, device=hidden.device)
    d_weights = weights_sorted.new_empty(plan.num_pairs)
    d_w1, d_b1, d_w2, d_b2 = (torch.zeros_like(p) for p in (w1, b1, w2, b2))
    for expert, start, end in plan.segments:
        tokens = plan.token_of_pair[start:end]
        weight = weights_sorted[start:end, None]
        gate_up = gate_up_all[start:end]
        grad_y = grad_out.index_select(0, tokens)
        grad_times_w2 = grad_y @ w2[expert].T
        h = _expert_hidden(gate_up, alpha, limit)
        d_weights[start:end] = (grad_times_w2.to(math_dtype) * h.to(math_dtype)).sum(-1) + grad_y.to(
            math_dtype
        ) @ b2[expert].to(math_dtype)
        grad_y_scaled = grad_y * weight
        d_w2[expert].addmm_(h.T, grad_y_scaled)
        d_b2[expert] += grad_y_scaled.sum(0)
        grad_h = grad_times_w2.to(math_dtype) * weight.to(math_dtype)
        d_gate_up = swiglu_clamped_backward(gate_up.to(math_dtype), grad_h, alpha, limit).to(hidden.dtype)
        d_w1[expert].addmm_(hidden.index_select(0, tokens).T, d_gate_up)
        d_b1[expert] += d_gate_up.sum(0)
        d_hidden.index_add_(0, tokens, (d_gate_up @ w1[expert].T).to(math_dtype))
    return d_hidden.to(hidden.dtype), d_weights, d_w1, d_b1, d_w2, d_b2


class SequentialExpertsFunction(torch.autograd.Function):
    """Autograd wrapper: saves ``hidden``, routing weights, expert weights and the ``[S, 2I]`` pre-activations."""

    @staticmethod
    def forward(ctx, hidden, top_k_weights, w1, b1, w2, b2, plan, alpha, limit, save):
        weights_sorted = top_k_weights.reshape(-1).index_select(0, plan.order)
        out, gate_up_all = _experts_forward(hidden, weights_sorted, plan, w1, b1, w2, b2, alpha, limit, save)
        ctx.plan, ctx.alpha, ctx.limit, ctx.weights_shape = plan, alpha, limit, top_k_weights.shape
        if save:
            ctx.save_for_backward(hidden, weights_sorted, gate_up_all, w1, b1, w2, b2)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        hidden, weights_sorted, gate_up_all, w1, b1, w2, b2 = ctx.saved_tensors
        d_hidden, d_weights_sorted, d_w1, d_b1, d_w2, d_b2 = _experts_backward(
            grad_out, hidden, weights_sorted, gate_up_all, ctx.plan, w1, b1, w2, b2, ctx.alpha, ctx.limit
        )
        d_weights = torch.empty_like(d_weights_sorted).index_copy_(0, ctx.plan.order, d_weights_sorted)
        d_weights = d_weights.reshape(ctx.weights_shape).to(weights_sorted.dtype)
        return d_hidden, d_weights, d_w1, d_b1, d_w2, d_b2, None, None, None, None


def sequential_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    *,
    alpha: float,
    limit: float,
    rows_per_chunk: int | None = None,
    layer_name: str = "experts",
) -> torch.Tensor:
    """GPT-OSS mixture of experts, one contiguous token slice per expert, identical in train and eval.

    Args:
        hidden_states: ``[T, H]``. top_k_index: integer ``[T, K]`` in ``[0, E)``. top_k_weights: ``[T, K]``,
            same dtype as ``hidden_states``. gate_up_proj ``[E, H, 2I]`` (interleaved), gate_up_proj_bias
            ``[E, 2I]``, down_proj ``[E, I, H]``, down_proj_bias ``[E, H]``.
        alpha, limit: GPT-OSS ``swiglu_alpha`` / ``swiglu_limit``.
        rows_per_chunk: at most this many (token, expert) rows per matmul (bounds the eval peak when routing
            is skewed); ``None`` = one matmul per expert.
        layer_name: used in error messages.
    Returns ``[T, H]``, differentiable in hidden_states, top_k_weights and all four expert parameters.
    Peak extra memory: ``[T, H]`` output + ``[T*K]`` indices + one slice's temporaries (eval); training adds
    the saved ``[T*K, 2I]`` pre-activations. No tensor ever has E x T x H elements.
    """
    plan = build_expert_plan(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        gate_up_proj_bias,
        down_proj,
        down_proj_bias,
        rows_per_chunk=rows_per_chunk,
        layer_name=layer_name,
    )
    tensors = (hidden_states, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias)
    # Inside Function.forward grad mode is off, so decide here whether backward will run (eval saves nothing).
    save_for_backward = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return SequentialExpertsFunction.apply(*tensors, plan, float(alpha), float(limit), save_for_backward)
