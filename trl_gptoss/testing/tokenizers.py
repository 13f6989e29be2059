"""Tokenizers for tests: the real o200k Harmony tokenizer (runtime code, re-exported) and a small 512-entry one.

The small tokenizer is a byte-level BPE of 512 entries with the same special-token strings (at ids 0..8),
the same pre-tokenisation regex and the same chat template as the real one, trained on a fixed corpus, so
it is deterministic and tiny models over it stay tiny. Everything but the BPE training is shared with
``trl_gptoss.harmony.tokenizer``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from trl_gptoss.harmony.tokenizer import (
    CACHE_VERSION,
    O200K_PATTERN,
    O200K_SHA256,
    atomic_write,
    cache_dir,
    load_harmony_tokenizer,
    o200k_encodings_dir,
    use_offline_harmony_vocab,
)
from trl_gptoss.harmony.tokenizer import harmony_tokenizer as real_harmony_tokenizer
from trl_gptoss.harmony.tokens import NAMED_SPECIAL_TOKENS

SMALL_VOCAB_SIZE = 512

__all__ = [
    "O200K_SHA256",
    "SMALL_VOCAB_SIZE",
    "harmony_tokenizer",
    "o200k_encodings_dir",
    "small_tokenizer_file",
    "use_offline_harmony_vocab",
]


def _small_corpus() -> list[str]:
    text = resources.files("trl_gptoss.testing").joinpath("assets/small_tokenizer_corpus.txt").read_text()
    return [line for line in text.splitlines() if line.strip()]


def small_tokenizer_file() -> Path:
    """The cached ``tokenizer.json`` of the 512-entry test vocabulary (trained on first use, ~1 s)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    target = cache_dir() / f"small_harmony_tokenizer_{CACHE_VERSION}.json"
    if target.exists():
        return target
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SMALL_VOCAB_SIZE,
        special_tokens=list(NAMED_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_small_corpus(), trainer=trainer)
    atomic_write(target, backend.to_str().encode())
    return target


def harmony_tokenizer(small: bool = False):
    """``small=False``: the real o200k tokenizer (``trl_gptoss.harmony.harmony_tokenizer``); ``small=True``:
    the 512-entry one. Both: Harmony special tokens, eos ``<|return|>``, pad ``<|endoftext|>``, chat template."""
    if not isinstance(small, bool):
        raise ValueError(f"small must be True or False, got {small!r}")
    return load_harmony_tokenizer(small_tokenizer_file()) if small else real_harmony_tokenizer()
