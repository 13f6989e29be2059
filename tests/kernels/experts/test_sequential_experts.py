"""``sequential_experts`` vs upstream ``GptOssExperts`` (eager loop): output and every gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from gptoss_kernels.experts import ExpertParams
from gptoss_kernels.experts.swiglu import swiglu_clamped, swiglu_clamped_consuming, swiglu_clamped_with_grad
from tests.kernels.experts.helpers import (
    GRAD_NAMES,
    forward_and_grads,
    max_rel_diff,
    op_of,
    random_routing,
    upstream_experts,
)

# (num_tokens, num_experts, top_k, allowed experts, rows_per_chunk)
CASES = {
    "random": (37, 4, 2, None, None),
    "expert_without_tokens": (29, 4, 2, [0, 1, 3], None),
    "one_token": (1, 4, 2, None, None),
    "all_tokens_one_expert": (23, 4, 1, [2], None),
    "top_k_equals_num_experts": (19, 4, 4, None, None),
    "chunked_rows": (41, 4, 3, None, 5),
    "eight_experts_top1": (33, 8, 1, None, 4),
}


def case_inputs(case, dtype, seed=0):
    num_tokens, num_experts, top_k, allowed, rows_per_chunk = CASES[case]
    reference = upstream_experts(num_experts, dtype=dtype, seed=seed)
    hidden = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    index, weights = random_routing(num_tokens, num_experts, top_k, seed=seed, allowed=allowed, dtype=dtype)
    return reference, hidden.to(dtype), index, weights, rows_per_chunk


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_upstream_eager(case, dtype):
    reference, hidden, index, weights, rows_per_chunk = case_inputs(case, dtype)
    expected = forward_and_grads(reference, reference, hidden, index, weights)
    actual = forward_and_grads(op_of(reference, rows_per_chunk), reference, hidden, index, weights)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    for name, got, want in zip(GRAD_NAMES, actual, expected):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        rel = max_rel_diff(got, want)
        assert rel <= tolerance, f"{case} {name}: max relative diff {rel:.2e} > {tolerance:.0e}"


def test_expert_without_tokens_gets_zero_gradient():
    reference, hidden, index, weights, _ = case_inputs("expert_without_tokens", torch.float32)
    grads = forward_and_grads(op_of(reference), reference, hidden, index, weights)
    for name, grad in zip(GRAD_NAMES[3:], grads[3:]):
        assert torch.count_nonzero(grad[2]) == 0, f"{name} of the unused expert 2 must be zero"
        assert torch.count_nonzero(grad[0]) > 0, f"{name} of a used expert must not be zero"


@pytest.mark.parametrize("case", ["random", "all_tokens_one_expert", "top_k_equals_num_experts"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_within_the_loops_own_error(case, dtype):
    """|sequential_lowp - ref64| <= 2 |upstream_lowp - ref64| + atol, for the output and every gradient."""
    reference64, hidden64, index, weights64, rows_per_chunk = case_inputs(case, torch.float64)
    exact = forward_and_grads(reference64, reference64, hidden64, index, weights64)
    low = copy.deepcopy(reference64).to(dtype)
    hidden, weights = hidden64.to(dtype), weights64.to(dtype)
    upstream_low = forward_and_grads(low, low, hidden, index, weights)
    ours_low = forward_and_grads(op_of(low, rows_per_chunk), low, hidden, index, weights)
    for name, ours, theirs, ref in zip(GRAD_NAMES, ours_low, upstream_low, exact):
        assert ours.dtype == dtype, name
        our_err = (ours.double() - ref).abs().max().item()
        their_err = (theirs.double() - ref).abs().max().item()
        atol = 1e-3 * ref.abs().max().item()
        assert our_err <= 2 * their_err + atol, f"{case} {name}: ours {our_err:.3e} vs loop {their_err:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_train_and_eval_are_bit_identical(dtype):
    """Eval clamps the pre-activations in place, train keeps them: the output must not differ by one bit."""
    reference, hidden, index, weights, _ = case_inputs("random", dtype)
    run = op_of(reference)
    train_out = run(hidden.requires_grad_(True), index, weights)
    with torch.no_grad():
        eval_out = run(hidden, index, weights)
    assert torch.equal(train_out.detach(), eval_out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_swiglu_variants_agree_bitwise(dtype):
    values = torch.linspace(-12, 12, 97, dtype=torch.float64)
    gate_up = torch.stack(torch.meshgrid(values, values, indexing="ij"), -1).reshape(-1, 194).to(dtype)
    math_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    kept = swiglu_clamped(gate_up, 1.702, 7.0, math_dtype).to(dtype)
    with_grad, _ = swiglu_clamped_with_grad(gate_up, torch.ones_like(kept, dtype=math_dtype), 1.702, 7.0)
    consumed = swiglu_clamped_consuming(gate_up.clone(), 1.702, 7.0)
    assert torch.equal(consumed, kept) and torch.equal(with_grad.to(dtype), kept)


@pytest.mark.parametrize("rows_per_block", [1, 5, 97, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_eval_swiglu_in_blocks_writes_h_into_the_pre_activations(dtype, rows_per_block):
    """Half-precision eval: fp32 math in row blocks (one row, a prime not dividing the rows, exactly the rows,
    more than the rows), ``h`` written over the consumed pre-activations' storage, bit-identical to the kept
    variant."""
    values = torch.linspace(-12, 12, 97, dtype=torch.float64)
    gate_up = torch.stack(torch.meshgrid(values, values, indexing="ij"), -1).reshape(-1, 194).to(dtype)
    kept = swiglu_clamped(gate_up, 1.702, 7.0, torch.float32).to(dtype)
    consumed_input = gate_up.clone()
    consumed = swiglu_clamped_consuming(consumed_input, 1.702, 7.0, rows_per_block=rows_per_block)
    assert torch.equal(consumed, kept)
    assert consumed.untyped_storage().data_ptr() == consumed_input.untyped_storage().data_ptr()


def test_empty_batch():
    reference, _, _, _, _ = case_inputs("random", torch.float32)
    hidden = torch.zeros(0, 32, requires_grad=True)
    out = op_of(reference)(hidden, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    out.sum().backward()
    assert out.shape == (0, 32) and hidden.grad.shape == (0, 32)


def test_swiglu_backward_matches_autograd_at_the_clamp_boundaries():
    limit, alpha = 7.0, 1.702
    values = torch.tensor([-9.0, -7.0, -6.5, -1.0, 0.0, 0.5, 6.999, 7.0, 7.001, 12.0], dtype=torch.float64)
    gate_up = torch.stack(torch.meshgrid(values, values, indexing="ij"), -1).reshape(-1, 2)  # gate, up pairs
    gate_up = gate_up.reshape(1, -1).requires_grad_(True)
    grad_h = torch.randn(1, gate_up.shape[1] // 2, dtype=torch.float64)
    reference = upstream_experts(dtype=torch.float64)
    reference.limit, reference.alpha = limit, alpha
    (expected,) = torch.autograd.grad(reference._apply_gate(gate_up), gate_up, grad_h)
    _, actual = swiglu_clamped_with_grad(gate_up.detach(), grad_h, alpha, limit)
    torch.testing.assert_close(actual, expected, rtol=1e-14, atol=1e-14)


def test_frozen_expert_parameters_get_no_gradient():
    """Frozen experts (e.g. LoRA elsewhere): no weight gradients computed, input and routing grads unchanged."""
    reference, hidden, index, weights, _ = case_inputs("random", torch.float32)
    expected = forward_and_grads(reference, reference, hidden, index, weights)
    frozen = copy.deepcopy(reference)
    frozen.down_proj.requires_grad_(False)
    frozen.gate_up_proj_bias.requires_grad_(False)
    hidden = hidden.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    out = op_of(frozen)(hidden, index, weights)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float()
    (out * cotangent).sum().backward()
    params = ExpertParams.of(frozen)
    assert params.down_proj.grad is None and params.gate_up_proj_bias.grad is None
    actual = {
        "d_hidden": hidden.grad,
        "d_routing_weights": weights.grad,
        "d_gate_up_proj": params.gate_up_proj.grad,
        "d_down_proj_bias": params.down_proj_bias.grad,
    }
    for name, grad in actual.items():
        assert max_rel_diff(grad, expected[GRAD_NAMES.index(name)]) <= 1e-6, name
