"""Packing, global label shift, padding, sharding and unpacking of GRPO-shaped batches."""

from __future__ import annotations

import pytest
import torch

from trl_gptoss.parallel import pack_rows, token_log_probs, unpack_token_values
from trl_gptoss.parallel.batching import IGNORE_INDEX, pad_to_multiple, shard
from trl_gptoss.parallel.masks import cu_seqlens, document_ids

IDS = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 4, 0, 0], [1, 2, 3, 4, 3]])
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0]])


def test_pack_rows_keeps_valid_tokens_and_shifts_labels_per_document():
    packed = pack_rows(IDS, MASK)
    assert packed.input_ids.tolist() == [5, 6, 7, 8, 9, 4, 2, 3, 4]
    assert packed.positions.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert packed.labels.tolist() == [6, 7, IGNORE_INDEX, 9, 4, IGNORE_INDEX, 3, 4, IGNORE_INDEX]
    assert cu_seqlens(packed.positions[None]).tolist() == [0, 3, 6, 9]


def test_unpack_puts_each_prediction_on_its_target_token():
    packed = pack_rows(IDS, MASK)
    values = torch.arange(1.0, 10.0, requires_grad=True)
    grid = unpack_token_values(values, packed)
    assert grid.tolist() == [[0, 0, 0, 1, 2], [0, 4, 5, 0, 0], [0, 0, 7, 8, 0]]
    grid.sum().backward()
    assert values.grad.tolist() == [1, 1, 0, 1, 1, 0, 1, 1, 0]  # documents' last tokens predict nothing


def test_labels_cross_shard_boundaries():
    """Shifting before slicing: the last token of shard 0 is labelled with the first token of shard 1."""
    packed = pack_rows(torch.arange(10)[None])
    first, second = shard(packed.labels, 0, 2), shard(packed.input_ids, 1, 2)
    assert int(first[-1]) == int(second[0])


def test_padding_forms_its_own_documents_and_is_ignored():
    packed = pack_rows(IDS, MASK)
    positions = pad_to_multiple(packed.positions, 4, 0)
    labels = pad_to_multiple(packed.labels, 4, IGNORE_INDEX)
    assert positions.shape[0] == labels.shape[0] == 12
    assert labels[9:].tolist() == [IGNORE_INDEX] * 3
    assert document_ids(positions[None])[0].tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 5, 6]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"input_ids must be \[B, L\]"):
        pack_rows(torch.arange(4))
    with pytest.raises(ValueError, match="must equal input_ids shape"):
        pack_rows(IDS, MASK[:, :3])
    with pytest.raises(ValueError, match="no valid tokens"):
        pack_rows(IDS, torch.zeros_like(MASK))
    with pytest.raises(ValueError, match="not a multiple of sp_size=2; pad it first"):
        shard(torch.arange(5), 0, 2)
    with pytest.raises(ValueError, match="expected 9 per-token values"):
        unpack_token_values(torch.zeros(4), pack_rows(IDS, MASK))


def test_token_log_probs_match_float64_log_softmax():
    logits = torch.randn(6, 11)
    labels = torch.tensor([3, IGNORE_INDEX, 0, 10, 5, IGNORE_INDEX])
    expected = torch.log_softmax(logits.double(), dim=-1)[torch.arange(6), labels.clamp(min=0)]
    expected[labels == IGNORE_INDEX] = 0
    got = token_log_probs(logits.bfloat16(), labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(token_log_probs(logits, labels).double(), expected, atol=1e-6, rtol=0)
    assert token_log_probs(logits.double(), labels).dtype == torch.float64
