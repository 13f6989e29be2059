"""Padding/packing layouts and the ``fa3_sink`` attention function called directly, against transformers'
own masks + GPT-OSS eager attention in float64 (output and every gradient, sinks included)."""

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import (
    causal_mask_function,
    eager_mask,
    find_packed_sequence_indices,
    sliding_window_causal_mask_function,
)
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from trl_gptoss.attention import (
    document_starts,
    fa3_sink_attention_forward,
    layout_from_cu_seqlens,
    packed_layout,
    span_layout,
)
from trl_gptoss.attention import interface as fa3_interface

F64 = torch.float64


@pytest.mark.parametrize(
    "positions",
    [
        [0, 1, 2, 5, 6, 0, 1],
        [0, 1, 2, 3],
        [3, 4, 0, 0, 1],
        [1, 1, 0, 1, 2],
        [0, 2, 4, 6],
    ],
    ids=["gap-then-reset", "plain", "offset-start", "left-pad-generate", "stride-2"],
)
def test_document_starts_is_transformers_packed_sequence_rule(positions):
    position_ids = torch.tensor([positions])
    ours = document_starts(position_ids).long().cumsum(-1) - 1
    theirs = find_packed_sequence_indices(position_ids)
    assert ours.tolist() == (theirs if theirs is not None else torch.zeros_like(ours)).tolist()


def test_gap_in_positions_starts_a_document():
    """``[0, 1, 2, 5, 6, 0, 1]``: three documents (the jump 2 -> 5 opens one, as in transformers)."""
    layout = packed_layout(1, 7, torch.tensor([[0, 1, 2, 5, 6, 0, 1]]), "cpu")
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 7] and layout.max_seqlen == 3


def test_plain_batch_needs_no_packing_and_layouts_are_cached():
    positions = torch.arange(6)[None]
    assert packed_layout(2, 6, positions, "cpu") is None
    packed = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert packed_layout(1, 6, packed, "cpu") is packed_layout(1, 6, packed, "cpu")


def test_span_layout_left_right_and_empty_rows_and_holes():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    spans = span_layout(mask)
    assert (spans.starts, spans.ends) == ((2, 0, 0), (5, 3, 0))
    assert spans.packed.token_index.tolist() == [2, 3, 4, 5, 6, 7] and spans.packed.cu_seqlens.tolist() == [0, 3, 6]
    rows, intervals = spans.pad_intervals(None, "cpu")
    assert rows.tolist() == [8, 9] and intervals.lo == (5, 5) and intervals.hi == (7, 7)
    assert spans.pad_intervals(1, "cpu") is None  # a window of 1 sees only the padding query itself
    assert span_layout(torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)) is None


def test_trl_cu_seq_lens_layout_and_its_checks():
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    layout = layout_from_cu_seqlens(cu, cu, 5, 9, "cpu")
    assert layout.cu_seqlens.tolist() == [0, 4, 9] and layout.max_seqlen == 5
    with pytest.raises(ValueError, match="differ"):
        layout_from_cu_seqlens(cu, torch.tensor([0, 9], dtype=torch.int32), 9, 9, "cpu")
    with pytest.raises(ValueError, match="packed length"):
        layout_from_cu_seqlens(cu, None, None, 12, "cpu")
    with pytest.raises(ValueError, match="shorter than the longest"):
        layout_from_cu_seqlens(torch.tensor([0, 4, 9], dtype=torch.int32), None, 3, 9, "cpu")


def _module(sinks, hq=4, hkv=2):
    return SimpleNamespace(is_causal=True, num_key_value_groups=hq // hkv, training=False, sinks=sinks)


def _leaves(batch, tq, tk, hq=4, hkv=2, dim=16):
    """transformers' layout, float64 leaves: query [B, Hq, Tq, D], key/value [B, Hkv, Tk, D], sinks [Hq]."""
    shapes = ((batch, hq, tq, dim), (batch, hkv, tk, dim), (batch, hkv, tk, dim), (hq,))
    return [torch.randn(s, dtype=F64).requires_grad_() for s in shapes]


def _eager(leaves, mask2d, window, tq, tk, positions=None):
    """transformers' eager_mask (padding, causal, window; documents from positions) + GPT-OSS eager."""
    query, key, value, sinks = leaves
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    additive = eager_mask(
        batch_size=query.shape[0],
        q_length=tq,
        kv_length=tk,
        q_offset=tk - tq,
        mask_function=mask_fn,
        attention_mask=mask2d,
        dtype=F64,
    )
    if positions is not None:  # documents, built with transformers' own packed-sequence ids
        docs = find_packed_sequence_indices(positions)
        additive = additive.masked_fill(docs[:, None, :, None] != docs[:, None, None, :], torch.finfo(F64).min)
    out, _ = eager_attention_forward(_module(sinks), query, key, value, additive, scaling=0.25)
    return out


def _assert_same_with_grads(got, want, leaves, atol=1e-10):
    grad_out = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, leaves, grad_out)
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    for name, g, w in zip(("o", "dq", "dk", "dv", "dsinks"), (got, *got_grads), (want, *want_grads)):
        diff = (g - w).abs().max().item()
        assert diff <= atol, f"{name}: max|diff| = {diff:.3e}"


MASKS = {
    "left": [[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 10],
    "right": [[1, 1, 1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]],
    "left-and-right": [[0, 0, 1, 1, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]],
    "holes-generate": [[1, 1, 0, 0, 1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0, 1, 0, 1, 1]],
    "empty-row": [[0] * 10, [1, 1, 1, 0, 1, 1, 0, 0, 0, 1]],
}


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
@pytest.mark.parametrize("mask_id", MASKS)
def test_prefill_with_any_padding_mask_equals_eager(mask_id, window):
    """Every query row, padding rows included, equals eager: padding masks keys, not queries."""
    mask = torch.tensor(MASKS[mask_id], dtype=torch.bool)
    leaves = _leaves(2, 10, 10)
    got, weights = fa3_sink_attention_forward(
        _module(leaves[3]), *leaves[:3], mask, scaling=0.25, sliding_window=window, s_aux=leaves[3]
    )
    assert weights is None
    _assert_same_with_grads(got, _eager(leaves, mask, window, 10, 10), leaves)


@pytest.mark.parametrize("window", [None, 4], ids=["full", "window4"])
@pytest.mark.parametrize("mask_id", ["left", "right", "holes-generate", "empty-row"])
def test_decoding_with_any_padding_mask_equals_eager(mask_id, window):
    """Tq < Tk (KV cache): queries are the last Tq positions; the mask covers all Tk keys."""
    mask = torch.tensor(MASKS[mask_id], dtype=torch.bool)
    leaves = _leaves(2, 3, 10)
    got, _ = fa3_sink_attention_forward(
        _module(leaves[3]), *leaves[:3], mask, scaling=0.25, sliding_window=window, s_aux=leaves[3]
    )
    _assert_same_with_grads(got, _eager(leaves, mask, window, 3, 10), leaves)


@pytest.mark.parametrize("window", [None, 2], ids=["full", "window2"])
def test_packed_positions_with_a_gap_equal_eager_with_transformers_documents(window):
    """``[0, 1, 2, 5, 6, 0, 1]`` -> documents [0,1,2], [5,6], [0,1] in fa3_sink and in eager."""
    positions = torch.tensor([[0, 1, 2, 5, 6, 0, 1]])
    leaves = _leaves(1, 7, 7)
    got, _ = fa3_sink_attention_forward(
        _module(leaves[3]),
        *leaves[:3],
        None,
        scaling=0.25,
        sliding_window=window,
        s_aux=leaves[3],
        position_ids=positions,
    )
    _assert_same_with_grads(got, _eager(leaves, None, window, 7, 7, positions), leaves)


def test_output_attentions_warns_and_returns_eager_weights(caplog, monkeypatch):
    monkeypatch.setattr(fa3_interface, "_WARNED", [])
    mask = torch.tensor(MASKS["holes-generate"], dtype=torch.bool)
    leaves = _leaves(2, 10, 10)
    with caplog.at_level(logging.WARNING, logger=fa3_interface.__name__):
        for _ in range(2):
            got, weights = fa3_sink_attention_forward(
                _module(leaves[3]),
                *leaves[:3],
                mask,
                scaling=0.25,
                sliding_window=3,
                s_aux=leaves[3],
                output_attentions=True,
            )
    assert sum("output_attentions=True" in r.getMessage() for r in caplog.records) == 1
    mask_fn = sliding_window_causal_mask_function(3)
    additive = eager_mask(
        batch_size=2, q_length=10, kv_length=10, mask_function=mask_fn, attention_mask=mask, dtype=F64
    )
    want, want_weights = eager_attention_forward(_module(leaves[3]), *leaves[:3], additive, scaling=0.25)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(weights, want_weights, atol=1e-12, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_no_sinks_is_plain_causal_attention(window):
    """s_aux=None must equal torch SDPA (no sink at all), not a zero sink."""
    query, key, value = (t.detach().float() for t in _leaves(2, 9, 9)[:3])
    out, weights = fa3_sink_attention_forward(
        _module(None), query, key, value, None, scaling=0.25, sliding_window=window, s_aux=None
    )
    pos = torch.arange(9)
    allowed = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window else True)
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=0.25, enable_gqa=True)
    assert weights is None
    assert (out - want.transpose(1, 2)).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "call, match",
    [
        (
            dict(attention_mask=torch.zeros(1, 1, 5, 5)),
            r"2-D keep-mask \[B=1, <= 5\] or None, got shape \(1, 1, 5, 5\)",
        ),
        (dict(attention_mask=torch.ones(2, 5, dtype=torch.bool)), r"got shape \(2, 5\)"),
        (dict(attention_mask=torch.ones(1, 6, dtype=torch.bool)), r"got shape \(1, 6\)"),
        (dict(dropout=0.1), "dropout"),
        (dict(is_causal=False), "causal"),
    ],
)
def test_unsupported_calls_raise(call, match):
    query, key, value, sinks = _leaves(1, 5, 5)
    kwargs = dict(attention_mask=None, scaling=0.25, s_aux=sinks)
    kwargs.update(call)
    with pytest.raises(ValueError, match=match):
        fa3_sink_attention_forward(_module(sinks), query, key, value, **kwargs)
