"""Structural memory check: record every tensor produced in forward + backward; none may have
num_experts x tokens x hidden elements (upstream's legacy repeat and batched_mm's per-pair weight copies do)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.kernels.experts.helpers import op_of, random_routing, upstream_experts

NUM_TOKENS, NUM_EXPERTS, TOP_K, HIDDEN = 256, 32, 2, 16


class LargestTensor(TorchDispatchMode):
    """Remembers the shape of the largest tensor any aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.numel, self.shape, self.op = 0, None, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.numel() > self.numel:
                self.numel, self.shape, self.op = leaf.numel(), tuple(leaf.shape), str(func)
        return out


def _largest_in_train_step(run) -> LargestTensor:
    hidden = torch.randn(NUM_TOKENS, HIDDEN, requires_grad=True)
    index, weights = random_routing(NUM_TOKENS, NUM_EXPERTS, TOP_K, dtype=torch.float32)
    weights.requires_grad_(True)
    with LargestTensor() as largest:
        run(hidden, index, weights).square().sum().backward()
    return largest


def test_no_tensor_grows_with_experts_times_tokens():
    largest = _largest_in_train_step(op_of(upstream_experts(NUM_EXPERTS, HIDDEN, HIDDEN, dtype=torch.float32)))
    pairs = NUM_TOKENS * TOP_K
    # Legit maxima: saved gate/up [T*K, 2I] and a full weight gradient [E, H, 2I] (both 16 Ki elements here).
    allowed = max(pairs * 2 * HIDDEN, NUM_EXPERTS * HIDDEN * 2 * HIDDEN)
    assert largest.numel <= allowed, f"largest tensor {largest.shape} from {largest.op} exceeds {allowed}"
    assert largest.numel * 8 <= NUM_EXPERTS * NUM_TOKENS * HIDDEN


def test_the_check_catches_per_pair_weight_copies():
    """Sensitivity: upstream batched_mm gathers one [H, 2I] weight per (token, k) pair and must trip the check."""
    reference = upstream_experts(NUM_EXPERTS, HIDDEN, HIDDEN, dtype=torch.float32)
    reference.config._experts_implementation = "batched_mm"
    largest = _largest_in_train_step(reference)
    assert largest.numel >= NUM_EXPERTS * NUM_TOKENS * HIDDEN, largest.shape


def test_eval_allocates_nothing_larger_than_the_output():
    """Without grad no [T*K, 2I] activation buffer is kept: the output [T, H] is the largest tensor."""
    run = op_of(upstream_experts(NUM_EXPERTS, HIDDEN, HIDDEN, dtype=torch.float32))
    hidden = torch.randn(NUM_TOKENS, HIDDEN)
    index, weights = random_routing(NUM_TOKENS, NUM_EXPERTS, TOP_K, dtype=torch.float32)
    with torch.no_grad(), LargestTensor() as largest:
        run(hidden, index, weights)
    assert largest.numel <= NUM_TOKENS * HIDDEN, f"{largest.shape} from {largest.op}"


class FreshBuffers(TorchDispatchMode):
    """Records every new buffer of at least ``min_numel`` elements an aten op returns while active (views and
    in-place results share an input's storage and are not new)."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel, self.buffers = min_numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            leaf.untyped_storage().data_ptr()
            for leaf in tree_leaves((args, kwargs or {}))
            if isinstance(leaf, torch.Tensor)
        }
        for leaf in tree_leaves(out):
            new = isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in inputs
            if new and leaf.numel() >= self.min_numel:
                self.buffers.append((str(func), tuple(leaf.shape), leaf.dtype))
        return out


# (weights and hidden states, routing weights, autocast dtype): the precision setups a recipe gives the op.
PRECISIONS = {
    "fp32": (torch.float32, torch.float32, None),
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "fp32_autocast_bf16": (torch.float32, torch.bfloat16, torch.bfloat16),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_eval_makes_one_token_sized_buffer_in_every_precision(precision):
    """Eval's only buffer of ``T x H`` elements or more is the output: under autocast the op once cast the
    whole input to bf16 up front (``T*H*2`` bytes alive for the whole call, 16 MiB at 16k tokens and H = 512),
    which put its peak above a plain per-expert loop's; each slice's gathered rows are cast instead."""
    dtype, routing_dtype, autocast = PRECISIONS[precision]
    run = op_of(upstream_experts(NUM_EXPERTS, HIDDEN, HIDDEN, dtype=dtype))
    hidden = torch.randn(NUM_TOKENS, HIDDEN, dtype=dtype)
    index, weights = random_routing(NUM_TOKENS, NUM_EXPERTS, TOP_K, dtype=routing_dtype)
    region = contextlib.nullcontext() if autocast is None else torch.autocast("cpu", dtype=autocast)
    with torch.no_grad(), region, FreshBuffers(NUM_TOKENS * HIDDEN) as fresh:
        out = run(hidden, index, weights)
    assert fresh.buffers == [("aten.zeros.default", tuple(out.shape), dtype)], fresh.buffers
