"""Render Harmony conversations to token ids, the way openai-harmony 0.0.8 does.

Every piece of a message is encoded on its own (role, `` to=...``, channel, content type, body), between
special tokens, exactly as the reference renderer does; merging pieces before encoding would change the
BPE boundaries and therefore the token ids the model sees.
"""

from __future__ import annotations

import dataclasses

from trl_gptoss.harmony.codec import codec_for
from trl_gptoss.harmony.messages import (
    PYTHON_NAMESPACE,
    DeveloperContent,
    Message,
    SystemContent,
    ToolNamespace,
    ToolSpec,
    message_from_dict,
)
from trl_gptoss.harmony.schema import schema_to_typescript
from trl_gptoss.harmony.tokens import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START


def _lines(text: str) -> list[str]:
    """Split like Rust's ``str::lines``: no trailing empty line, ``\\r\\n`` counts as one break."""
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    return [p[:-1] if p.endswith("\r") else p for p in parts]


def _namespace_section(ns: ToolNamespace) -> str:
    lines = [f"## {ns.name}\n"]
    if ns.description:
        prefix = "// " if ns.tools else ""
        lines += [prefix + line for line in _lines(ns.description)]
    if ns.tools:
        lines.append(f"namespace {ns.name} {{\n")
        for tool in ns.tools:
            lines += [f"// {line}" for line in _lines(tool.description)]
            params = "" if tool.parameters is None else f"_: {schema_to_typescript(tool.parameters)}"
            lines.append(f"type {tool.name} = ({params}) => any;\n")
        lines.append(f"}} // namespace {ns.name}")
    return "\n".join(lines)


def tools_section(namespaces) -> str:
    ordered = sorted(namespaces, key=lambda ns: ns.name)  # the reference keeps namespaces in a sorted map
    return "\n\n".join(["# Tools"] + [_namespace_section(ns) for ns in ordered])


def system_text(system: SystemContent, has_function_tools: bool) -> str:
    top = [system.model_identity] if system.model_identity else []
    if system.knowledge_cutoff:
        top.append(f"Knowledge cutoff: {system.knowledge_cutoff}")
    if system.conversation_start_date:
        top.append(f"Current date: {system.conversation_start_date}")
    sections = ["\n".join(top)] if top else []
    if system.reasoning_effort:
        sections.append(f"Reasoning: {system.reasoning_effort}")
    if system.tools:
        sections.append(tools_section(system.tools))
    if system.valid_channels:
        header = f"# Valid channels: {', '.join(system.valid_channels)}."
        if system.channel_required:
            header += " Channel must be included for every message."
        if has_function_tools:
            header += "\nCalls to these tools must go to the commentary channel: 'functions'."
        sections.append(header)
    return "\n\n".join(sections)


def developer_text(developer: DeveloperContent) -> str:
    sections = ["# Instructions", developer.instructions] if developer.instructions is not None else []
    if developer.tools:
        sections.append(tools_section(developer.tools))
    return "\n\n".join(sections)


def _content_text(message: Message, has_function_tools: bool) -> str:
    if isinstance(message.content, SystemContent):
        if message.role != "system":
            raise ValueError(f"SystemContent may only appear in a system message, found in {message.role}")
        return system_text(message.content, has_function_tools)
    if isinstance(message.content, DeveloperContent):
        if message.role != "developer":
            raise ValueError(f"DeveloperContent may only appear in a developer message, found in {message.role}")
        return developer_text(message.content)
    return message.content


def _header_ids(message: Message, codec) -> list[int]:
    author = message.name if message.role == "tool" else message.role
    ids = codec.encode_text(author)
    if message.role != "tool" and message.name:
        ids += codec.encode_text(f":{message.name}")
    if message.recipient and message.recipient != "all":
        ids += codec.encode_text(f" to={message.recipient}")
    if message.channel is not None:
        ids += [codec.special(CHANNEL)] + codec.encode_text(message.channel)
    if message.content_type is not None:
        if message.content_type.startswith(CONSTRAIN):
            rest = message.content_type[len(CONSTRAIN) :]
            ids += codec.encode_text(" ") + [codec.special(CONSTRAIN)] + codec.encode_text(rest)
        else:
            ids += codec.encode_text(f" {message.content_type}")
    return ids


def render_message(message: Message, tokenizer, *, has_function_tools: bool = False) -> list[int]:
    """``<|start|>{header}<|message|>{content}<|end|>`` (``<|call|>`` for an assistant tool call)."""
    codec = codec_for(tokenizer)
    ids = [codec.special(START)] + _header_ids(message, codec) + [codec.special(MESSAGE)]
    ids += codec.encode_text(_content_text(message, has_function_tools))
    is_call = message.role == "assistant" and message.recipient is not None
    ids.append(codec.special(CALL if is_call else END))
    return ids


def _split_instructions(conversation):
    """System/developer dicts → instruction texts; everything else → Messages. Errors name the index."""
    if isinstance(conversation, (str, bytes, dict)) or not hasattr(conversation, "__iter__"):
        raise ValueError(f"a conversation is a list of message dicts or Messages, got {type(conversation).__name__}")
    instructions, body = [], []
    for index, item in enumerate(conversation):
        try:
            if isinstance(item, Message):
                body.append(item)
            elif isinstance(item, dict) and item.get("role") in ("system", "developer"):
                if not isinstance(item.get("content"), str):
                    raise ValueError(
                        f"field 'content' of a {item['role']} message must be a string, got {item.get('content')!r}"
                    )
                instructions.append(item["content"])
            else:
                body.extend(message_from_dict(item))
        except ValueError as exc:
            raise ValueError(f"conversation[{index}]: {exc}") from None
    return instructions, body


def build_messages(conversation, *, tools=(), system=None, python_tool: bool = False) -> list[Message]:
    """Chat dicts / Messages → the full Harmony message list.

    A system message (``system``, default ``SystemContent()``; ``False`` for none) is prepended unless the
    conversation already holds a system ``Message``. Dict messages with role system/developer become the
    developer message's instructions; ``tools`` (function tools) go to its ``functions`` namespace.
    ``python_tool=True`` declares the builtin ``python`` tool in the system message.
    """
    instructions, body = _split_instructions(conversation)
    specs = tuple(ToolSpec.coerce(t) for t in (tools or ()))
    messages = []
    if system is not False and not any(m.role == "system" for m in body):
        system = system if system is not None else SystemContent()
        if python_tool:
            system = dataclasses.replace(system, tools=system.tools + (PYTHON_NAMESPACE,))
        messages.append(Message("system", system))
    if instructions or specs:
        if any(m.role == "developer" for m in body):
            raise ValueError("pass instructions/tools either as a developer Message or as dicts/tools=, not both")
        namespaces = (ToolNamespace("functions", None, specs),) if specs else ()
        messages.append(Message("developer", DeveloperContent("\n\n".join(instructions) or None, namespaces)))
    return messages + body


def _has_function_tools(messages) -> bool:
    return any(
        isinstance(m.content, DeveloperContent) and any(ns.name == "functions" and ns.tools for ns in m.content.tools)
        for m in messages
    )


def _drop_early_analysis(messages):
    """The reference drops analysis before the first final message once the last assistant turn is final."""
    last_assistant = next((m for m in reversed(messages) if m.role == "assistant"), None)
    if last_assistant is None or last_assistant.channel != "final":
        return messages
    first_final = next(i for i, m in enumerate(messages) if m.channel == "final")
    return [m for i, m in enumerate(messages) if not (i < first_final and m.channel == "analysis")]


def render_conversation(
    conversation,
    tokenizer,
    *,
    tools=(),
    system=None,
    python_tool: bool = False,
    add_generation_prompt: bool = False,
    drop_analysis: bool = True,
    for_training: bool = False,
) -> list[int]:
    """Render a conversation (chat dicts and/or ``Message``s) to token ids.

    ``add_generation_prompt`` appends ``<|start|>assistant`` for sampling; ``for_training`` ends a final
    answer with ``<|return|>`` instead of ``<|end|>``; ``drop_analysis`` mirrors openai-harmony's default of
    dropping chain-of-thought that precedes an earlier final answer.
    """
    codec = codec_for(tokenizer)
    messages = build_messages(conversation, tools=tools, system=system, python_tool=python_tool)
    has_tools = _has_function_tools(messages)
    rendered = _drop_early_analysis(messages) if drop_analysis else messages
    ids = [tok for m in rendered for tok in render_message(m, codec, has_function_tools=has_tools)]
    last = messages[-1] if messages else None
    if for_training and last is not None and last.role == "assistant" and last.channel == "final":
        ids[-1] = codec.special(RETURN)
    if add_generation_prompt:
        ids += [codec.special(START)] + codec.encode_text("assistant")
    return ids
