"""Token-level access to a Harmony tokenizer: plain text and special tokens kept strictly apart.

Harmony encodes message text "ordinarily": a user who types ``<|end|>`` gets the characters, not the control
token. A transformers fast tokenizer would turn such text into the special token, so text goes through a copy
of the backend with ``encode_special_tokens`` switched on.
"""

from __future__ import annotations

import copy
import functools

from trl_gptoss.harmony.tokens import NAMED_SPECIAL_TOKENS, STOP_TOKENS


class HarmonyCodec:
    """Wraps a ``PreTrainedTokenizerFast`` that carries the Harmony special tokens."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("the Harmony codec needs a fast (Rust-backed) tokenizer; got a slow one")
        missing = [name for name in NAMED_SPECIAL_TOKENS if backend.token_to_id(name) is None]
        if missing:
            raise ValueError(
                f"tokenizer lacks the Harmony special tokens {missing}; use "
                "trl_gptoss.harmony.harmony_tokenizer() or the GPT-OSS checkpoint's tokenizer"
            )
        self.tokenizer = tokenizer
        self._decoder = backend
        self._text_encoder = copy.deepcopy(backend)
        self._text_encoder.encode_special_tokens = True
        self.special_ids = {name: backend.token_to_id(name) for name in NAMED_SPECIAL_TOKENS}
        self.special_names = {token_id: name for name, token_id in self.special_ids.items()}
        self.all_special_ids = frozenset(tid for tid, tok in tokenizer.added_tokens_decoder.items() if tok.special)
        self.stop_ids = frozenset(self.special_ids[name] for name in STOP_TOKENS)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def encode_text(self, text: str) -> list[int]:
        """Ordinary encoding: special-token strings inside ``text`` stay text."""
        return self._text_encoder.encode(text, add_special_tokens=False).ids if text else []

    def special(self, name: str) -> int:
        return self.special_ids[name]

    def decode(self, token_ids) -> str:
        """Decode with special tokens spelled out; invalid UTF-8 becomes U+FFFD."""
        return self._decoder.decode(list(token_ids), skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.all_special_ids


@functools.lru_cache(maxsize=8)
def _cached_codec(tokenizer) -> HarmonyCodec:
    return HarmonyCodec(tokenizer)


def codec_for(tokenizer) -> HarmonyCodec:
    """A cached codec per tokenizer object (building one copies the backend)."""
    return tokenizer if isinstance(tokenizer, HarmonyCodec) else _cached_codec(tokenizer)
