"""OpenAI Harmony format: render conversations to token ids and parse completions back.

``render_conversation(conversation, tokenizer, ...) -> list[int]`` and
``parse_completion(token_ids, tokenizer) -> ParsedCompletion`` are the entry points; both work with the real
o200k Harmony tokenizer and with the small test tokenizer, and match openai-harmony 0.0.8 token for token.
``harmony_tokenizer()`` is the real o200k tokenizer (offline), whose chat template renders the same ids.
"""

from trl_gptoss.harmony.codec import HarmonyCodec, codec_for
from trl_gptoss.harmony.messages import (
    DeveloperContent,
    Message,
    SystemContent,
    ToolNamespace,
    ToolSpec,
    message_from_dict,
)
from trl_gptoss.harmony.parse import ParsedCompletion, ParseError, ToolCall, parse_completion
from trl_gptoss.harmony.render import build_messages, render_conversation, render_message
from trl_gptoss.harmony.tokenizer import harmony_chat_template, harmony_tokenizer, use_offline_harmony_vocab
from trl_gptoss.harmony.tokens import STOP_TOKENS, STOP_TOKENS_FOR_ASSISTANT_ACTIONS

__all__ = [
    "STOP_TOKENS",
    "STOP_TOKENS_FOR_ASSISTANT_ACTIONS",
    "DeveloperContent",
    "HarmonyCodec",
    "Message",
    "ParseError",
    "ParsedCompletion",
    "SystemContent",
    "ToolCall",
    "ToolNamespace",
    "ToolSpec",
    "build_messages",
    "codec_for",
    "harmony_chat_template",
    "harmony_tokenizer",
    "message_from_dict",
    "parse_completion",
    "render_conversation",
    "render_message",
    "use_offline_harmony_vocab",
]
