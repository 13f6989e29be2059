"""Parse a completion's token ids back into Harmony messages and tool calls; no token stream makes it raise.

A completion sampled after ``<|start|>assistant`` starts inside the first message's header. Messages end
with ``<|end|>``, ``<|call|>`` or ``<|return|>``; the next one must open with ``<|start|>``. The header
grammar follows openai-harmony 0.0.8: the channel is cut out first (it ends at Unicode whitespace or ``<``), the
rest is trimmed of Unicode whitespace and splits on ASCII whitespace only into role, ``to=recipient`` and
content type, so both header orders parse alike::

    assistant to=functions.f<|channel|>commentary json
    assistant<|channel|>commentary to=functions.f <|constrain|>json

Model output is untrusted: whatever cannot be read becomes a ``ParseError`` (the trainer can show the model a
"malformed tool call" message) and parsing resumes at the next ``<|start|>``.
"""

from __future__ import annotations

import functools
import json
import operator
import re
from dataclasses import dataclass, field

from trl_gptoss.harmony.codec import codec_for
from trl_gptoss.harmony.messages import ROLES, Message
from trl_gptoss.harmony.tokens import CHANNEL, CONSTRAIN, MESSAGE, START


@dataclass(frozen=True)
class ParseError:
    """``kind``: truncated | unexpected_token | malformed_header | unterminated_message | invalid_token."""

    kind: str
    message: str
    position: int  # index of the offending token in the completion


@dataclass(frozen=True)
class ToolCall:
    name: str  # "get_weather" for functions.get_weather; "python" for the builtin tool
    arguments: str  # the raw message body (JSON text for function tools, code for python)
    recipient: str
    namespace: str | None = None
    channel: str | None = None
    content_type: str | None = None

    def parsed_arguments(self):
        """The arguments as JSON; ``ValueError`` with the reason when they are not valid JSON."""
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments of tool call {self.recipient} are not valid JSON: {exc}") from None


@dataclass
class ParsedCompletion:
    messages: list[Message] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    error: ParseError | None = None  # the first problem found; None when well-formed
    errors: list[ParseError] = field(default_factory=list)
    truncated: bool = False  # the last message never reached a stop token
    stop_token: int | None = None  # the token that closed the last complete message
    spans: list[tuple[int, int]] = field(default_factory=list)  # token range [start, end) of each message

    @property
    def final_answer(self) -> str | None:
        finals = [m.text for m in self.messages if m.role == "assistant" and m.channel == "final"]
        return finals[-1] if finals else None


class _HeaderError(Exception):
    pass


# openai-harmony (Rust) ends a channel value at ``char::is_whitespace`` and trims the header with ``str::trim``
# (both Unicode White_Space, which lacks U+001C..U+001F that Python's isspace includes), then splits the header
# with ``split_ascii_whitespace`` (space, tab, LF, FF, CR): ``to=python\u00a0code`` is one recipient there.
_WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
)
_ASCII_WHITESPACE = re.compile("[ \t\n\x0c\r]+")


def _split_header(header: str) -> list[str]:
    return [part for part in _ASCII_WHITESPACE.split(header) if part]


def _cut_channel(header: str) -> tuple[str, str | None]:
    idx = header.find(CHANNEL)
    if idx < 0:
        return header, None
    after = header[idx + len(CHANNEL) :]
    end = next((i for i, ch in enumerate(after) if ch in _WHITE_SPACE or ch == "<"), len(after))
    if end == 0:
        raise _HeaderError("channel marker present but no channel value follows it")
    return header[:idx] + after[end:], after[:end]


def _role_and_rest(parts: list[str], role: str | None) -> tuple[str, str | None, list[str]]:
    name = None
    if role is None:
        if not parts:
            raise _HeaderError("message header does not name a role")
        if parts[0] in ROLES:
            role = parts[0]
        elif len(parts) > 1 or parts[0].startswith("to="):
            role, name = "tool", parts.pop(0)  # an unknown author with a recipient is a tool (functions.X)
        else:
            raise _HeaderError(f"unknown role {parts[0]!r}")
    if parts and parts[0] == role:
        parts.pop(0)
    return role, name, parts


def _recipient_and_type(parts: list[str]) -> tuple[str | None, str | None]:
    if not parts:
        return None, None
    count, last = len(parts), parts.pop()
    if last.startswith("to="):
        return last[3:], None
    if count == 1:
        return last, None
    raw = parts.pop()
    return (raw[3:] if raw.startswith("to=") else raw), last


def parse_header(header: str, role: str | None) -> Message:
    """One decoded header (special tokens spelled out) → an empty ``Message`` carrying its metadata."""
    header, channel = _cut_channel(header)
    header = header.strip(_WHITE_SPACE)
    if CONSTRAIN in header:
        header = header.replace(CONSTRAIN, f" {CONSTRAIN}").strip(_WHITE_SPACE)
    role, name, parts = _role_and_rest(_split_header(header), role)
    recipient, content_type = _recipient_and_type(parts)
    if parts:
        raise _HeaderError(f"unexpected text in message header: {' '.join(parts)!r}")
    if role == "tool" and not name:
        name = recipient or "tool"
    return Message(role, "", channel=channel, recipient=recipient, content_type=content_type, name=name)


def _tool_call(message: Message) -> ToolCall:
    namespace, _, short = message.recipient.rpartition(".")
    return ToolCall(short, message.text, message.recipient, namespace or None, message.channel, message.content_type)


class _CompletionParser:
    """The token-by-token state machine behind ``parse_completion``."""

    def __init__(self, codec, role: str | None):
        self.codec = codec
        self.out = ParsedCompletion()
        self.start_id, self.message_id = codec.special(START), codec.special(MESSAGE)
        self.state = "header" if role is not None else "expect_start"
        self.role = role
        self.header: list[int] = []
        self.body: list[int] = []
        self.current: Message | None = None
        self.msg_start = 0

    def fail(self, kind: str, message: str, position: int) -> None:
        error = ParseError(kind, message, position)
        self.out.errors.append(error)
        self.out.error = self.out.error or error

    def open_message(self, position: int, role: str | None) -> None:
        self.state, self.role, self.header, self.msg_start = "header", role, [], position

    def feed(self, position: int, token) -> None:
        token_id = _token_id(token)
        if token_id is None or not 0 <= token_id < self.codec.vocab_size:
            self.fail("invalid_token", f"token {token!r} is not an id of this vocabulary", position)
            return
        getattr(self, f"_on_{self.state}")(position, token_id)

    def _on_expect_start(self, position: int, token: int) -> None:
        if token == self.start_id:
            self.open_message(position, None)
        elif token not in self.codec.stop_ids:
            self.fail("unexpected_token", f"expected <|start|> between messages, got token {token}", position)
            self.state = "skip"

    def _on_skip(self, position: int, token: int) -> None:
        if token == self.start_id:
            self.open_message(position, None)

    def _on_header(self, position: int, token: int) -> None:
        if token == self.message_id:
            try:
                self.current = parse_header(self.codec.decode(self.header), self.role)
            except _HeaderError as exc:
                self.fail("malformed_header", str(exc), position)
                self.state = "skip"
                return
            self.state, self.body = "content", []
        elif token in self.codec.stop_ids or token == self.start_id:
            self.fail("malformed_header", "message header ended before <|message|>", position)
            if token == self.start_id:
                self.open_message(position, None)
            else:
                self.state = "expect_start"
        else:
            self.header.append(token)

    def _on_content(self, position: int, token: int) -> None:
        if token in self.codec.stop_ids:
            self.close_message(position + 1, token)
        elif token == self.start_id:
            self.fail("unterminated_message", "<|start|> inside a message body (missing <|end|>)", position)
            self.close_message(position, None)
            self.open_message(position, None)
        else:
            self.body.append(token)

    def close_message(self, end: int, stop_token: int | None) -> None:
        message = self.current
        message.content = self.codec.decode(self.body)
        self.out.messages.append(message)
        self.out.spans.append((self.msg_start, end))
        complete = stop_token is not None
        if complete:
            self.out.stop_token = stop_token
        if complete and message.role == "assistant" and message.recipient and message.recipient != "all":
            self.out.tool_calls.append(_tool_call(message))
        self.state, self.current = "expect_start", None

    def finish(self, length: int) -> ParsedCompletion:
        if self.state == "content":
            self.out.truncated = True
            self.fail("truncated", "the completion ended inside a message (token budget exhausted?)", length)
            self.close_message(length, None)
        elif self.state == "header":
            self.out.truncated = True
            self.fail("truncated", "the completion ended inside a message header", length)
        return self.out


def parse_completion(token_ids, tokenizer=None, *, role: str | None = "assistant") -> ParsedCompletion:
    """Parse completion token ids (sampled after ``<|start|>assistant``) into messages and tool calls.

    ``token_ids``: ONE completion, a sequence of integer ids of any integer type (``list[int]``, numpy
    integers, a 1-D integer ``torch.Tensor`` or numpy array). ``role=None`` parses a stream that begins with
    ``<|start|>`` (a whole rendered conversation). ``tokenizer`` defaults to the real GPT-OSS tokenizer.

    Never raises on bad token streams: an element that is not an id of the vocabulary is an
    ``invalid_token`` error, and problems are reported in ``.error`` / ``.errors``; a tool call is only
    reported for a message that reached its stop token. A ``token_ids`` that is not one sequence of ids
    (``None``, a string, a 2-D tensor or a batch of lists, a float tensor) is a programming error, not a
    completion: ``TypeError``/``ValueError`` saying what to pass.
    """
    tokenizer = _real_tokenizer() if tokenizer is None else tokenizer
    if role is not None and role not in ROLES:
        raise ValueError(f"role must be one of {ROLES} or None, got {role!r}")
    tokens = _token_list(token_ids)
    parser = _CompletionParser(codec_for(tokenizer), role)
    for position, token in enumerate(tokens):
        parser.feed(position, token)
    return parser.finish(len(tokens))


_WHAT_TO_PASS = "pass one completion's ids: a list of ints, or a 1-D integer torch.Tensor / numpy array"


def _token_list(token_ids) -> list:
    """One completion's ids as a list (elements unchecked: the parser reports bad ones as ``invalid_token``)."""
    if token_ids is None or isinstance(token_ids, (str, bytes, dict)) or not hasattr(token_ids, "__iter__"):
        raise TypeError(f"token_ids must be a sequence of token ids, got {type(token_ids).__name__}; {_WHAT_TO_PASS}")
    dtype = str(getattr(token_ids, "dtype", "int"))
    if "int" not in dtype:
        raise TypeError(f"token_ids must hold integer ids, got dtype {dtype}; {_WHAT_TO_PASS}")
    ndim = getattr(token_ids, "ndim", 1)
    if ndim != 1:
        shape = tuple(getattr(token_ids, "shape", ()))
        raise ValueError(f"token_ids must be 1-D, got shape {shape}; parse each row (one completion) separately")
    tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
    if any(isinstance(t, (list, tuple)) or getattr(t, "ndim", 0) for t in tokens):
        raise ValueError(f"token_ids holds sequences (a batch?); {_WHAT_TO_PASS}, one call per completion")
    return tokens


def _token_id(token) -> int | None:
    """``token`` as an int when it is one of any integer type (numpy, 0-d tensor); ``None`` otherwise."""
    if isinstance(token, bool) or "bool" in str(getattr(token, "dtype", "")):
        return None
    try:
        return operator.index(token)
    except TypeError:
        return None


@functools.lru_cache(maxsize=1)
def _real_tokenizer():
    from trl_gptoss.harmony.tokenizer import harmony_tokenizer

    return harmony_tokenizer()
