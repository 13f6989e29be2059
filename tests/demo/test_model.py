"""The demo model's initialisation: sinks that matter and the copy prior that stands in for pre-training."""

import pytest
import torch

from trl_gptoss.demo.model import EMBEDDING_NORM, SINK_INIT_RANGE, build_tiny_gpt_oss
from trl_gptoss.harmony import harmony_tokenizer


@pytest.fixture(scope="module")
def model():
    return build_tiny_gpt_oss(harmony_tokenizer(), seed=3)


def test_head_starts_as_an_untied_copy_of_the_unit_norm_embedding(model):
    embedding, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert head.data_ptr() != embedding.data_ptr() and torch.equal(head, embedding)
    norms = embedding.norm(dim=1)
    pad = model.config.pad_token_id
    assert norms[pad] == 0  # the padding row stays zero (no 0/0)
    assert torch.allclose(torch.cat([norms[:pad], norms[pad + 1 :]]), torch.tensor(EMBEDDING_NORM))


def test_last_layer_passes_the_attended_token_through(model):
    """With attention on a single key, the last layer's attention output is that token's normalised input:
    value and output projections are the identity (o_proj averages the heads)."""
    attention = model.model.layers[-1].self_attn
    x = torch.randn(5, model.config.hidden_size)
    values = attention.v_proj(x).view(5, -1, attention.head_dim)  # [T, kv_heads, head_dim]
    heads = values.repeat_interleave(attention.num_key_value_groups, dim=1).reshape(5, -1)
    torch.testing.assert_close(attention.o_proj(heads) - attention.o_proj.bias, x)


def test_sinks_start_large_and_the_init_is_a_function_of_the_seed(model):
    low, high = SINK_INIT_RANGE
    sinks = torch.cat([layer.self_attn.sinks for layer in model.model.layers])
    assert low <= sinks.min() and sinks.max() <= high and sinks.std() > 0.3
    again = build_tiny_gpt_oss(harmony_tokenizer(), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
