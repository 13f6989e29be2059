"""Padding/packing helpers and the ``fa3_sink`` attention function called directly."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gptoss_kernels import sink_attention_ref
from trl_gptoss.attention import fa3_sink_attention_forward, layout_from_cu_seqlens, packed_layout, valid_spans


def test_valid_spans_left_right_and_empty_rows():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    assert valid_spans(mask) == ([2, 0, 0], [5, 3, 0])


def test_padding_holes_are_refused():
    with pytest.raises(ValueError, match="contiguous span"):
        valid_spans(torch.tensor([[1, 0, 1, 1]]))


def test_plain_batch_needs_no_packing():
    assert packed_layout(2, 6, None, torch.arange(6)[None], "cpu") is None


def test_position_resets_and_padding_become_documents():
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [1, 1, 0, 1, 0, 1]])
    layout = packed_layout(2, 6, mask, position_ids, "cpu")
    assert layout.token_index.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 10]
    assert layout.cu_seqlens.dtype == torch.int32 and layout.max_seqlen == 3


def test_trl_cu_seq_lens_layout_and_its_checks():
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    layout = layout_from_cu_seqlens(cu, cu, 5, 9, "cpu")
    assert layout.cu_seqlens.tolist() == [0, 4, 9] and layout.max_seqlen == 5
    with pytest.raises(ValueError, match="differ"):
        layout_from_cu_seqlens(cu, torch.tensor([0, 9], dtype=torch.int32), 9, 9, "cpu")
    with pytest.raises(ValueError, match="packed length"):
        layout_from_cu_seqlens(cu, None, None, 12, "cpu")


def _module(hq=4, hkv=2):
    return SimpleNamespace(is_causal=True, num_key_value_groups=hq // hkv, training=False)


def _heads_first(batch, tq, tk, hq=4, hkv=2, dim=16):
    """transformers' layout: query [B, Hq, Tq, D], key/value [B, Hkv, Tk, D]."""
    return torch.randn(batch, hq, tq, dim), torch.randn(batch, hkv, tk, dim), torch.randn(batch, hkv, tk, dim)


@pytest.mark.parametrize("window", [None, 3])
def test_no_sinks_is_plain_causal_attention(window):
    """s_aux=None must equal torch SDPA (no sink at all), not a zero sink."""
    query, key, value = _heads_first(2, 9, 9)
    out, weights = fa3_sink_attention_forward(_module(), query, key, value, None, scaling=0.25,
                                              sliding_window=window, s_aux=None)
    pos = torch.arange(9)
    allowed = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window else True)
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=0.25, enable_gqa=True)
    assert weights is None
    assert (out - want.transpose(1, 2)).abs().max().item() <= 1e-5


def test_decoding_with_padding_matches_each_row_alone():
    """Tq < Tk with a 2-D mask: row 0 left-padded, row 1 right-padded (its last query is padding)."""
    query, key, value = _heads_first(2, 2, 10)
    sinks = torch.randn(4)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    out, _ = fa3_sink_attention_forward(_module(), query, key, value, mask, scaling=0.25, sliding_window=4,
                                        s_aux=sinks)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    row0 = sink_attention_ref(q[:1], k[:1, 3:], v[:1, 3:], sinks, window=4, scale=0.25)
    row1 = sink_attention_ref(q[1:, :1], k[1:, :9], v[1:, :9], sinks, window=4, scale=0.25)
    assert (out[:1] - row0).abs().max().item() <= 1e-5
    assert (out[1:, :1] - row1).abs().max().item() <= 1e-5
    assert (out[1, 1] == 0).all(), "a padding query returns zeros"


@pytest.mark.parametrize("call, match", [
    (dict(attention_mask=torch.zeros(1, 1, 5, 5)), "2-D keep-mask"),
    (dict(dropout=0.1), "dropout"),
    (dict(is_causal=False), "causal"),
])
def test_unsupported_calls_raise(call, match):
    query, key, value = _heads_first(1, 5, 5)
    kwargs = dict(attention_mask=None, scaling=0.25, s_aux=torch.zeros(4))
    kwargs.update(call)
    with pytest.raises(ValueError, match=match):
        fa3_sink_attention_forward(_module(), query, key, value, **kwargs)
