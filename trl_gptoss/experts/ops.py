"""Sequential (sort-once, one contiguous slice per expert) GPT-OSS experts with a hand-written backward.

Math, for a token ``t`` routed to experts ``e_1..e_K`` with routing weights ``w_1..w_K``::

    gu        = x_t @ W1[e] + b1[e]                        W1: [E, H, 2I] (gate/up interleaved), b1: [E, 2I]
    gate, up  = gu[..., 0::2], gu[..., 1::2]
    g, u      = min(gate, L), clamp(up, -L, L)               L = swiglu_limit
    h         = (u + 1) * g * sigmoid(alpha * g)             [I]
    y         = h @ W2[e] + b2[e]                            W2: [E, I, H], b2: [E, H]
    out_t     = sum_k w_k * y_k                              [H]

Layers (STYLE.md #1): ``swiglu_clamped``/``swiglu_clamped_with_grad`` (elementwise math) →
``_experts_forward``/``_experts_backward`` (loops over expert slices, allocate outputs) →
``SequentialExpertsFunction`` (saves tensors, calls the loops) → ``sequential_experts`` (public).

Why a custom backward: autograd through a per-expert loop materialises a full ``[E, H, 2I]`` gradient for
every ``W1[e]`` index and a full ``[T, H]`` gradient for every token gather, i.e. work that grows with E x T. Here
the weight gradients are written slice by slice into one buffer, and the only activation saved for backward is the
``[T*K, 2I]`` gate/up pre-activation (grouped_mm's autograd saves the gathered input, gate/up, the gate's
intermediates and the down output as well). Eval (no grad) saves nothing.

Precision: the gate math runs in fp32 for half inputs; the output accumulates in the input dtype, as upstream's
loop does (an fp32 buffer would double eval's output memory); ``d_hidden`` accumulates in fp32.
"""

from __future__ import annotations

import torch

from trl_gptoss.experts.plan import ExpertPlan, build_expert_plan

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """Elementwise math and accumulation run in fp32 for half types (more accurate than the upstream loop)."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float, math_dtype: torch.dtype | None = None):
    """GPT-OSS gated activation: ``gate_up [N, 2I]`` (gate at even, up at odd columns) → ``[N, I]``.

    ``h = (clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, L)``, computed in ``math_dtype``
    (default: the input's), same operation order as upstream ``GptOssExperts._apply_gate``.
    """
    math_dtype = math_dtype or gate_up.dtype
    gate = gate_up[..., 0::2].to(math_dtype, copy=True).clamp_(max=limit)
    up_plus_one = gate_up[..., 1::2].to(math_dtype, copy=True).clamp_(min=-limit, max=limit).add_(1)
    glu = gate.mul_(torch.mul(gate, alpha).sigmoid_())
    return up_plus_one.mul_(glu)


def swiglu_clamped_with_grad(
    gate_up: torch.Tensor, grad_h: torch.Tensor, alpha: float, limit: float, grad_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``swiglu_clamped(gate_up)`` ``[N, I]`` (in ``grad_h``'s dtype) and its gradient w.r.t. ``gate_up: [N, 2I]``
    (in ``grad_dtype``, default ``gate_up``'s) given ``grad_h: [N, I]``, sharing one sigmoid.

    With ``s = sigmoid(alpha*g)``, ``glu = g s``: ``dh/dg = (u+1) (s + alpha glu (1-s))``, ``dh/du = glu``; the
    clamps pass the gradient where the input lies in the closed interval (torch's convention: ``gate <= L``,
    ``-L <= up <= L``).
    """
    math_dtype = grad_h.dtype
    raw_gate, raw_up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = raw_gate.to(math_dtype, copy=True).clamp_(max=limit)
    up_plus_one = raw_up.to(math_dtype, copy=True).clamp_(min=-limit, max=limit).add_(1)
    sig = torch.mul(gate, alpha).sigmoid_()
    glu = gate.mul_(sig)
    # Write both halves straight into the interleaved (and possibly lower-precision) gradient buffer.
    d_gate_up = torch.empty(gate_up.shape, dtype=grad_dtype or gate_up.dtype, device=gate_up.device)
    d_gate, d_up = d_gate_up[..., 0::2], d_gate_up[..., 1::2]
    torch.mul(grad_h, glu, out=d_up).masked_fill_(raw_up.abs() > limit, 0)
    d_glu = torch.sub(1, sig).mul_(glu).mul_(alpha).add_(sig)
    torch.mul(d_glu.mul_(grad_h), up_plus_one, out=d_gate).masked_fill_(raw_gate > limit, 0)
    return glu.mul_(up_plus_one), d_gate_up


def swiglu_clamped_backward(gate_up: torch.Tensor, grad_h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Gradient of ``swiglu_clamped`` w.r.t. ``gate_up: [N, 2I]`` given ``grad_h: [N, I]``."""
    return swiglu_clamped_with_grad(gate_up, grad_h, alpha, limit)[1]


def _expert_hidden(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``swiglu_clamped`` with fp32 math for half inputs, result in the input dtype (feeds the down matmul)."""
    return swiglu_clamped(gate_up, alpha, limit, _math_dtype(gate_up.dtype)).to(gate_up.dtype)


def _experts_forward(hidden, weights_sorted, plan: ExpertPlan, w1, b1, w2, b2, alpha, limit, save_gate_up):
    """Run every expert on its contiguous slice of the sorted (token, k) pairs.

    hidden: [T, H]; weights_sorted: [S] routing weights in plan order (S = T*K).
    Returns ``out: [T, H]`` and, when ``save_gate_up``, the pre-activations ``[S, 2I]`` in plan order.
    """
    # Accumulate in the output dtype like upstream: an fp32 buffer for half inputs would cost 2x the output
    # (3x with the final cast) in eval, where the target is the loop's peak. Each index_add_ call has
    # distinct token rows (top-k experts are distinct), so it is deterministic on CUDA too.
    out = torch.zeros_like(hidden)
    gate_up_all = hidden.new_empty(plan.num_pairs, w1.shape[-1]) if save_gate_up else None
    for expert, start, end in plan.segments:
        tokens = plan.token_of_pair[start:end]
        slot = None if gate_up_all is None else gate_up_all[start:end]  # write the saved activation in place
        # mm + add_ rather than addmm: oneDNN caches a primitive per (shape, post-op) and the fused-bias ones
        # measurably grow the cold-start RSS on CPU.
        gate_up = torch.mm(hidden.index_select(0, tokens), w1[expert], out=slot).add_(b1[expert])
        expert_out = torch.mm(_expert_hidden(gate_up, alpha, limit), w2[expert]).add_(b2[expert])
        out.index_add_(0, tokens, expert_out.mul_(weights_sorted[start:end, None]))
    return out, gate_up_all


def _accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``out = a @ b`` on an expert's first chunk (no read of stale memory), ``out += a @ b`` after."""
    if first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


def _experts_backward(
    grad_out, hidden, weights_sorted, gate_up_all, plan: ExpertPlan, w1, b1, w2, b2, alpha, limit, needs_param_grad
):
    """Gradients of ``_experts_forward``: (d_hidden [T,H], d_weights_sorted [S], dW1, db1, dW2, db2).

    Per slice (g = dL/dout gathered for the slice, w = routing weights, h = swiglu(gate_up)):
    ``gW = g W2^T``; ``dL/dw = rowsum(gW * h) + g . b2`` (equals ``<g, y>`` without recomputing y);
    ``dy = w g``; ``dW2 += h^T dy``; ``db2 += sum dy``; ``dgu = swiglu'(gate_up, w gW)``;
    ``dW1 += x^T dgu``; ``db1 += sum dgu``; ``d_hidden[tokens] += dgu W1^T``.
    Weight gradients start uninitialised: each expert's first chunk overwrites its slice, experts without
    tokens are zeroed at the end (no full-size memset per call). ``needs_param_grad`` (4 bools, for W1, b1, W2,
    b2) skips the gradients of frozen parameters (e.g. LoRA elsewhere): ``None`` is returned for them.
    """
    math_dtype = _math_dtype(hidden.dtype)
    grad_out = grad_out.contiguous()
    d_hidden = torch.zeros(hidden.shape, dtype=math_dtype, device=hidden.device)
    d_weights = weights_sorted.new_empty(plan.num_pairs)
    d_w1, d_b1, d_w2, d_b2 = (torch.empty_like(p) if need else None for p, need in zip((w1, b1, w2, b2),
                                                                                        needs_param_grad))
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
        if d_w2 is not None:
            _accumulate_mm(d_w2[expert], h.to(hidden.dtype).T, grad_y_scaled, first)
        if d_w1 is not None:
            _accumulate_mm(d_w1[expert], hidden.index_select(0, tokens).T, d_gate_up, first)
        for bias_grad, rows in ((d_b2, grad_y_scaled), (d_b1, d_gate_up)):
            if bias_grad is not None and first:
                torch.sum(rows, 0, out=bias_grad[expert])
            elif bias_grad is not None:
                bias_grad[expert] += rows.sum(0)
        d_hidden.index_add_(0, tokens, (d_gate_up @ w1[expert].T).to(math_dtype))
    for expert in set(range(w1.shape[0])) - seen:
        for grad in (d_w1, d_b1, d_w2, d_b2):
            if grad is not None:
                grad[expert].zero_()
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
            grad_out, hidden, weights_sorted, gate_up_all, ctx.plan, w1, b1, w2, b2, ctx.alpha, ctx.limit,
            ctx.needs_input_grad[2:6],
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
