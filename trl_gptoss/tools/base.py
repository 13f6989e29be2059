"""Tools the model may call: a description, a JSON schema, a call that returns a ``ToolResult``, and what the
rollout loop needs to serve a tool without knowing its class.

Harmony declares tools two ways: builtin tools in the system message (GPT-OSS's ``python``: the model writes
``to=python`` and the raw code is the message body) and function tools in the developer message
(``to=functions.NAME`` with a JSON object as the body). ``builtin_name`` says which one a tool is declared
as, ``description`` is the text the model reads either way, ``recipients`` the addresses it answers, and
``new_session()`` the per-conversation object whose ``call`` serves one conversation's calls.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

from trl_gptoss.tools.result import ToolResult

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_JSON_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}


class ToolSession(Protocol):
    """What serves one conversation's calls to one tool: ``call(body)`` with the raw Harmony call body."""

    def call(self, arguments: str | dict) -> ToolResult: ...


class Tool(ABC):
    """A callable tool with a JSON-schema description.

    Subclasses set ``name``, ``description`` and ``parameters`` (a JSON schema of type ``object``) and
    implement ``_invoke(arguments: dict) -> ToolResult``. A tool with state per conversation overrides
    ``new_session``; a tool declared as a Harmony builtin sets ``builtin_name`` (and its ``call`` accepts
    that builtin's raw body).
    """

    name: str
    description: str
    parameters: dict
    builtin_name: str | None = None  # declared in the system message as this builtin; None: functions.NAME

    def __init__(self):
        if not isinstance(getattr(self, "name", None), str) or not _NAME.match(self.name):
            raise ValueError(f"Tool name must match {_NAME.pattern} (Harmony addresses it as functions.NAME).")
        if self.parameters.get("type") != "object":
            raise ValueError(f"Tool {self.name!r}: parameters must be a JSON schema with type 'object'.")

    @property
    def recipients(self) -> tuple[str, ...]:
        """Every Harmony recipient this tool answers (``to=...``): its builtin name, then ``functions.NAME``."""
        builtin = (self.builtin_name,) if self.builtin_name else ()
        return (*builtin, f"functions.{self.name}")

    def new_session(self) -> ToolSession:
        """The object that serves one conversation's calls; a stateless tool serves them itself."""
        return self

    def configured(self, *, builtin: bool | None = None, stateful: bool | None = None) -> Tool:
        """This tool declared as a builtin or not and with or without per-conversation state, where it offers
        that choice (None keeps its own); a tool without the choice returns itself."""
        return self

    @property
    def schema(self) -> dict:
        """``{"name", "description", "parameters"}``: what the Harmony developer message renders."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def to_harmony_dict(self) -> dict:
        return dict(self.schema)

    def to_openai_dict(self) -> dict:
        """The chat-template form ``{"type": "function", "function": schema}`` (transformers, vLLM)."""
        return {"type": "function", "function": self.schema}

    def parse_arguments(self, arguments: str | dict) -> dict:
        """Turn a call's body into checked keyword arguments; ``ValueError`` says what is wrong."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise ValueError(f"Tool {self.name!r}: arguments are not valid JSON ({exc}).") from exc
        if not isinstance(arguments, dict):
            raise ValueError(f"Tool {self.name!r}: arguments must be a JSON object, got {type(arguments).__name__}.")
        properties = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        unknown = [k for k in arguments if k not in properties]
        if missing or unknown:
            raise ValueError(f"Tool {self.name!r}: missing arguments {missing}, unknown arguments {unknown}.")
        for key, value in arguments.items():
            type_name = properties[key].get("type")
            expected = _JSON_TYPES.get(type_name)
            # bool is an int in Python but not a JSON number: reject True for "integer"/"number".
            wrong_bool = isinstance(value, bool) and type_name != "boolean"
            if expected is not None and (wrong_bool or not isinstance(value, expected)):
                raise ValueError(f"Tool {self.name!r}: argument {key!r} must be a JSON {type_name}.")
        return arguments

    def call(self, arguments: str | dict) -> ToolResult:
        """Run the tool on a Harmony call body (JSON text or dict)."""
        return self._invoke(self.parse_arguments(arguments))

    @abstractmethod
    def _invoke(self, arguments: dict) -> ToolResult: ...

    def as_function(self) -> Callable[..., str]:
        """A typed, documented function for TRL's ``GRPOTrainer(tools=[...])``: returns the rendered text."""
        raise NotImplementedError(f"Tool {self.name!r} has no function form.")
