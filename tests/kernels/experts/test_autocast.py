"""``sequential_experts`` under ``torch.autocast`` (``bf16: true`` / ``fp16: true`` over fp32 or bf16 weights):
runs where stock ``GptOssExperts`` runs, casts as autocast casts stock's matmuls, gradients in stock's dtypes.

fp32 weights + ``bf16: true`` is TRL's default ``GRPOConfig`` and what DDP or one GPU gets from accelerate's
autocast; before this op followed autocast, its first training step raised "routing_weights has dtype
torch.bfloat16 but hidden_states has torch.float32".
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.kernels.experts.helpers import (
    GRAD_NAMES,
    forward_and_grads,
    max_rel_diff,
    op_of,
)
from tests.kernels.experts.test_sequential_experts import case_inputs
from trl_gptoss.testing import tiny_gpt_oss

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHTS = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Cases of test_sequential_experts (same inputs): random routing, an expert without tokens, chunked rows.
CASES = ["random", "expert_without_tokens", "chunked_rows"]


def _inputs(case):
    """``(reference64, hidden64, index, weights64, rows_per_chunk)``: the float64 inputs of ``case``."""
    return case_inputs(case, torch.float64)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("autocast", list(AUTOCAST))
def test_within_stocks_own_error_under_autocast(autocast, weights, case):
    """|ours - ref64| <= 2 |stock - ref64| + atol for the output and every gradient, both under autocast, and
    every result in stock's dtype (parameter gradients in the parameters' dtype, fp32 masters stay fp32)."""
    reference64, hidden64, index, weights64, rows_per_chunk = _inputs(case)
    exact = forward_and_grads(reference64, reference64, hidden64, index, weights64)
    low = copy.deepcopy(reference64).to(WEIGHTS[weights])
    # The router's softmax runs under autocast too: routing weights arrive in the autocast dtype.
    hidden, routing = hidden64.to(WEIGHTS[weights]), weights64.to(AUTOCAST[autocast])
    with torch.autocast("cpu", dtype=AUTOCAST[autocast]):
        ours = forward_and_grads(op_of(low, rows_per_chunk), low, hidden, index, routing)
        stock = forward_and_grads(low, low, hidden, index, routing)
    for name, got, theirs, ref in zip(GRAD_NAMES, ours, stock, exact):
        assert got.dtype == theirs.dtype, f"{name}: {got.dtype}, stock {theirs.dtype}"
        our_err = (got.double() - ref).abs().max().item()
        their_err = (theirs.double() - ref).abs().max().item()
        atol = 1e-3 * ref.abs().max().item()
        assert our_err <= 2 * their_err + atol, f"{case} {name}: ours {our_err:.3e} vs stock {their_err:.3e}"


@pytest.mark.parametrize("autocast", list(AUTOCAST))
def test_fp32_weights_forward_is_bit_identical_to_stock(autocast):
    """Same casts, same order: the matmul in the autocast dtype, bias, gate, weighting and sum in fp32."""
    reference64, hidden64, index, weights64, _ = _inputs("random")
    experts = reference64.float()
    with torch.autocast("cpu", dtype=AUTOCAST[autocast]), torch.no_grad():
        ours = op_of(experts)(hidden64.float(), index, weights64.to(AUTOCAST[autocast]))
        stock = experts(hidden64.float(), index, weights64.to(AUTOCAST[autocast]))
    assert ours.dtype == torch.float32 and torch.equal(ours, stock)


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward_outside", "backward_inside"])
def test_backward_is_the_same_inside_and_outside_autocast(backward_inside):
    """Trainers call backward outside the autocast region, but one inside must not change the gradients."""
    reference64, hidden64, index, weights64, _ = _inputs("random")
    experts = reference64.float()
    hidden = hidden64.float().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = op_of(experts)(hidden, index, weights64.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=backward_inside):
        grads = torch.autograd.grad(out.square().sum(), [hidden, experts.gate_up_proj, experts.down_proj])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_out = op_of(experts)(hidden, index, weights64.bfloat16())
    expected = torch.autograd.grad(expected_out.square().sum(), [hidden, experts.gate_up_proj, experts.down_proj])
    for name, got, want in zip(["d_hidden", "d_gate_up_proj", "d_down_proj"], grads, expected):
        assert torch.equal(got, want), name


def test_without_autocast_mixed_dtypes_are_still_refused():
    """Outside autocast there is no rule to cast by: a dtype mismatch is an error that says what to change."""
    reference64, hidden64, index, weights64, _ = _inputs("random")
    with pytest.raises(ValueError, match=r"routing_weights has dtype torch.bfloat16.*torch.autocast"):
        op_of(reference64.float())(hidden64.float(), index, weights64.bfloat16())


@pytest.mark.parametrize("autocast", list(AUTOCAST))
def test_fp32_model_trains_under_autocast_like_stock(autocast):
    """The defect as users met it: a whole tiny GPT-OSS in fp32, forward and backward under autocast, with
    ``gptoss_sequential`` experts -- loss and every gradient within stock experts' own autocast error."""
    stock = tiny_gpt_oss(seed=3)
    stock.set_experts_implementation("eager")  # upstream's per-expert loop (grouped_mm has no float64)
    ours = copy.deepcopy(stock)
    ours.set_experts_implementation("gptoss_sequential")
    exact = copy.deepcopy(stock).double()
    ids = torch.randint(0, stock.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))

    def loss_and_grads(model, dtype=None):
        model.train()
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    exact_loss, exact_grads = loss_and_grads(exact)
    our_loss, our_grads = loss_and_grads(ours, AUTOCAST[autocast])
    stock_loss, stock_grads = loss_and_grads(stock, AUTOCAST[autocast])
    assert abs(our_loss.double() - exact_loss) <= 2 * abs(stock_loss.double() - exact_loss) + 1e-3
    for name, exact_grad in exact_grads.items():
        assert our_grads[name].dtype == torch.float32, name
        our_err = (our_grads[name].double() - exact_grad).abs().max().item()
        their_err = (stock_grads[name].double() - exact_grad).abs().max().item()
        atol = 1e-3 * exact_grad.abs().max().item()
        assert our_err <= 2 * their_err + atol, f"{name}: ours {our_err:.3e} vs stock {their_err:.3e}"
        assert max_rel_diff(our_grads[name], stock_grads[name]) < 0.1, name
