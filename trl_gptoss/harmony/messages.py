"""Harmony messages, and the conversion from chat-style dicts (TRL / OpenAI conventions) to them."""

from __future__ import annotations

import json
from dataclasses import dataclass

DEFAULT_MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
DEFAULT_CHANNELS = ("analysis", "commentary", "final")
JSON_CONTENT_TYPE = "<|constrain|>json"
# The builtin ``python`` namespace's description, as the model saw it in training (openai-harmony 0.0.8): what
# ``python_tool=True`` declares. A tool declared as the builtin gives its own text (``trl_gptoss.tools``).
PYTHON_NAMESPACE_DESCRIPTION = (
    "Use this tool to execute Python code in your chain of thought. The code will not be shown to the user. "
    "This tool should be used for internal reasoning, but not for code that is intended to be visible to the "
    "user (e.g. when creating plots, tables, or files).\n\nWhen you send a message containing Python code to "
    "python, it will be executed in a stateful Jupyter notebook environment. python will respond with the "
    "output of the execution or time out after 120.0 seconds. The drive at '/mnt/data' can be used to save "
    "and persist user files. Internet access for this session is UNKNOWN. Depends on the cluster."
)
ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("low", "medium", "high")
_THINKING_KEYS = ("thinking", "reasoning_content", "reasoning")  # where chat dicts keep chain-of-thought


@dataclass(frozen=True)
class ToolSpec:
    """A function tool: ``parameters`` is a JSON schema (or None for a tool without arguments)."""

    name: str
    description: str = ""
    parameters: dict | None = None

    @classmethod
    def coerce(cls, tool) -> ToolSpec:
        """Accept a ToolSpec, an object with ``to_harmony_dict()``, ``{"name", ...}`` or OpenAI's
        ``{"type": "function", "function": {...}}``."""
        if isinstance(tool, ToolSpec):
            return tool
        if hasattr(tool, "to_harmony_dict"):
            tool = tool.to_harmony_dict()
        if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
            tool = tool["function"]
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ValueError(
                f"a tool must be a dict with a non-empty 'name' (and 'description', 'parameters'), got {tool!r}"
            )
        return cls(tool["name"], tool.get("description") or "", tool.get("parameters"))


@dataclass(frozen=True)
class ToolNamespace:
    name: str
    description: str | None = None
    tools: tuple[ToolSpec, ...] = ()


PYTHON_NAMESPACE = ToolNamespace("python", PYTHON_NAMESPACE_DESCRIPTION)


@dataclass(frozen=True)
class SystemContent:
    """The system message: identity, dates, reasoning effort, builtin tools, channel rules."""

    model_identity: str | None = DEFAULT_MODEL_IDENTITY
    reasoning_effort: str | None = "medium"
    knowledge_cutoff: str | None = "2024-06"
    conversation_start_date: str | None = None
    tools: tuple[ToolNamespace, ...] = ()
    valid_channels: tuple[str, ...] = DEFAULT_CHANNELS
    channel_required: bool = True

    def __post_init__(self):
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(
                f"reasoning_effort must be one of {REASONING_EFFORTS} or None, got {self.reasoning_effort!r}"
            )


@dataclass(frozen=True)
class DeveloperContent:
    instructions: str | None = None
    tools: tuple[ToolNamespace, ...] = ()


@dataclass
class Message:
    """One Harmony message. ``name`` is the author name (tool results: ``functions.NAME`` or ``python``)."""

    role: str
    content: str | SystemContent | DeveloperContent = ""
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    name: str | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.content, (str, SystemContent, DeveloperContent)):
            raise ValueError(
                f"Message content must be a str, SystemContent or DeveloperContent, got "
                f"{type(self.content).__name__} {self.content!r}"
            )
        for name in ("channel", "recipient", "content_type", "name"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise ValueError(f"Message {name} must be a str or None, got {getattr(self, name)!r}")
        if self.role == "tool" and not self.name:
            raise ValueError("a tool message needs a name (the tool that produced it, e.g. 'functions.get_weather')")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else ""


def tool_author_name(name: str) -> str:
    """``get_weather`` → ``functions.get_weather``; names that already carry a namespace, and builtin
    ``python``, stay as they are."""
    return name if "." in name or name == "python" else f"functions.{name}"


def _arguments_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _text_field(item: dict, key: str) -> str | None:
    """``item[key]`` when it is a string or absent/None; ``ValueError`` naming the field otherwise.

    Falsy non-strings (``0``, ``[]``, ``False``) are refused too: treating them as "" would drop them silently.
    """
    value = item.get(key)
    if value is None or isinstance(value, str):
        return value
    hint = " (join the text parts into one string)" if isinstance(value, list) else ""
    raise ValueError(f"field {key!r} must be a string or None, got {type(value).__name__} {value!r}{hint}")


def _assistant_from_dict(item: dict) -> list[Message]:
    content = _text_field(item, "content")
    if item.get("channel") is not None or item.get("recipient") is not None:
        return [
            Message(
                "assistant",
                content or "",
                _text_field(item, "channel"),
                _text_field(item, "recipient"),
                _text_field(item, "content_type"),
            )
        ]
    out = []
    thinking = next((text for key in _THINKING_KEYS if (text := _text_field(item, key))), None)
    if thinking:
        out.append(Message("assistant", thinking, channel="analysis"))
    calls = item.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise ValueError(f"field 'tool_calls' must be a list or None, got {type(calls).__name__} {calls!r}")
    calls = calls or []
    if content:
        out.append(Message("assistant", content, channel="commentary" if calls else "final"))
    for call in calls:
        fn = call.get("function", call)
        if not isinstance(fn, dict) or not fn.get("name"):
            raise ValueError(f"a tool call needs a function name, got {call!r}")
        out.append(
            Message(
                "assistant",
                _arguments_text(fn.get("arguments", {})),
                channel="commentary",
                recipient=tool_author_name(fn["name"]),
                content_type=JSON_CONTENT_TYPE,
            )
        )
    return out


def message_from_dict(item: dict) -> list[Message]:
    """Convert one chat dict to Harmony messages (an assistant dict may expand to several)."""
    if not isinstance(item, dict) or item.get("role") not in ROLES:
        raise ValueError(f"each message must be a dict with a role in {ROLES}, got {item!r}")
    role = item["role"]
    if role == "assistant":
        return _assistant_from_dict(item)
    content = _text_field(item, "content") or ""
    if role == "tool":
        name = _text_field(item, "name") or _text_field(item, "tool_name")
        if not name:
            raise ValueError("a tool message dict needs 'name' (the tool that produced the result)")
        return [
            Message(
                "tool",
                content,
                channel=item.get("channel", "commentary"),
                recipient=item.get("recipient", "assistant"),
                name=tool_author_name(name),
            )
        ]
    return [Message(role, content, channel=item.get("channel"))]
