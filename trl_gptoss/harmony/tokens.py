"""Harmony special tokens: names, ids in the real o200k_harmony vocabulary, and which ones stop sampling."""

from __future__ import annotations

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
CALL = "<|call|>"
RETURN = "<|return|>"
START_OF_TEXT = "<|startoftext|>"
END_OF_TEXT = "<|endoftext|>"

# Ids in the real GPT-OSS vocabulary (o200k_harmony); every other id in 199998..201087 is <|reserved_N|>.
O200K_HARMONY_SPECIAL_IDS = {
    START_OF_TEXT: 199998,
    END_OF_TEXT: 199999,
    RETURN: 200002,
    CONSTRAIN: 200003,
    CHANNEL: 200005,
    START: 200006,
    END: 200007,
    MESSAGE: 200008,
    CALL: 200012,
}
O200K_SPECIAL_RANGE = range(199998, 201088)

# The named tokens in a fixed order: the small test tokenizer gives them ids 0..len-1 in this order.
NAMED_SPECIAL_TOKENS = tuple(O200K_HARMONY_SPECIAL_IDS)

# <|end|> closes a message and sampling may go on; <|return|> (final answer) and <|call|> (tool call) stop it.
STOP_TOKENS = (RETURN, END, CALL)
STOP_TOKENS_FOR_ASSISTANT_ACTIONS = (RETURN, CALL)


def o200k_special_tokens() -> dict[str, int]:
    """Every special token of the real vocabulary, named or reserved, as ``{text: id}``."""
    named_ids = set(O200K_HARMONY_SPECIAL_IDS.values())
    reserved = {f"<|reserved_{i}|>": i for i in O200K_SPECIAL_RANGE if i not in named_ids}
    return {**O200K_HARMONY_SPECIAL_IDS, **reserved}
