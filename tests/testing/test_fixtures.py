"""Offline fixtures: tiny model factory, tokenizers, vocabulary integrity."""

import hashlib

import pytest
import torch

from trl_gptoss.harmony.tokens import NAMED_SPECIAL_TOKENS, O200K_HARMONY_SPECIAL_IDS
from trl_gptoss.testing import harmony_tokenizer, save_tiny_checkpoint, tiny_gpt_oss, tiny_gpt_oss_config
from trl_gptoss.testing.models import SINK_INIT_RANGE
from trl_gptoss.testing.tokenizers import O200K_SHA256, o200k_encodings_dir


def test_tiny_config_shape():
    config = tiny_gpt_oss_config()
    assert config.head_dim == 64 and config.num_attention_heads % config.num_key_value_heads == 0
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.num_experts_per_tok >= 2 and config.vocab_size >= 512
    assert tiny_gpt_oss_config(num_hidden_layers=4).layer_types[2] == "sliding_attention"


def test_tiny_model_is_deterministic_and_sinks_are_large():
    a, b, c = tiny_gpt_oss(seed=1), tiny_gpt_oss(seed=1), tiny_gpt_oss(seed=2)
    ids = torch.randint(0, 512, (1, 70))
    assert torch.equal(a(ids).logits, b(ids).logits)
    assert not torch.equal(a(ids).logits, c(ids).logits)
    sinks = torch.cat([layer.self_attn.sinks for layer in a.model.layers])
    low, high = SINK_INIT_RANGE
    assert sinks.min() >= low and sinks.max() <= high and sinks.std() > 0.5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(head_dim=0), "head_dim must be a positive int"),
        (dict(vocab_size=100), "vocab_size must be >= 512"),
        (dict(num_attention_heads=6, num_key_value_heads=4), "must be a multiple of"),
        (dict(num_experts_per_tok=1), r"num_experts_per_tok must be in \[2, "),
        (dict(num_experts_per_tok=5), r"num_experts_per_tok must be in \[2, num_local_experts=4\]"),
        (dict(sliding_window=-3), "sliding_window must be a positive int"),
    ],
    ids=["head-dim", "vocab", "gqa", "topk-low", "topk-high", "window"],
)
def test_factory_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_gpt_oss_config(**kwargs)


def test_factory_rejects_bad_dtype_and_mixed_arguments():
    with pytest.raises(ValueError, match="dtype"):
        tiny_gpt_oss(dtype=torch.int32)
    with pytest.raises(ValueError, match="either config or field overrides"):
        tiny_gpt_oss(tiny_gpt_oss_config(), hidden_size=64)


def test_small_tokenizer_layout():
    tok = harmony_tokenizer(small=True)
    assert len(tok) == 512
    assert tok.convert_tokens_to_ids(list(NAMED_SPECIAL_TOKENS)) == list(range(len(NAMED_SPECIAL_TOKENS)))
    text = "Natalia sold 48 clips. 東京 😀"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token == "<|return|>" and tok.pad_token == "<|endoftext|>"
    with pytest.raises(ValueError, match="small must be True or False"):
        harmony_tokenizer(small="yes")


def test_real_tokenizer_vocabulary():
    tok = harmony_tokenizer()
    assert len(tok) == 201088
    for name, token_id in O200K_HARMONY_SPECIAL_IDS.items():
        assert tok.convert_tokens_to_ids(name) == token_id, name
    assert tok.convert_tokens_to_ids("<|reserved_200013|>") == 200013
    vocab = o200k_encodings_dir() / "o200k_base.tiktoken"
    assert hashlib.sha256(vocab.read_bytes()).hexdigest() == O200K_SHA256


def test_saved_checkpoint_round_trips(tmp_path):
    from transformers import AutoTokenizer, GptOssForCausalLM

    model = tiny_gpt_oss(seed=3)
    path = save_tiny_checkpoint(tmp_path / "ckpt", model)
    loaded = GptOssForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (1, 40))
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("<|call|>") == 8
