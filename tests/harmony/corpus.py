"""A seeded corpus of varied Harmony conversations, and their translation to openai-harmony objects."""

from __future__ import annotations

import random

from trl_gptoss.harmony import DeveloperContent, Message, SystemContent, ToolNamespace, build_messages

SCHEMAS = [
    None,
    {"type": "object", "properties": {}},
    {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source to run"}},
        "required": ["code"],
    },
    {
        "type": "object",
        "description": "Lookup options",
        "properties": {
            "location": {"type": "string", "description": "City name", "examples": ["Paris", "東京"]},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            "days": {"type": "integer", "default": 3, "title": "Days"},
            "verbose": {"type": "boolean", "nullable": True},
            "tags": {"type": "array", "items": {"type": "string"}},
            "raw": {"type": "array"},
            "id": {"type": ["number", "string"], "default": -1},
            "nested": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "string", "default": "x"}},
                "required": ["a"],
            },
        },
        "required": ["location"],
    },
    {
        "type": "object",
        "properties": {
            "target": {
                "description": "What to hit",
                "oneOf": [
                    {"type": "string", "description": "What to hit"},
                    {"type": "number", "description": "An index", "default": 0},
                    {"type": "object", "properties": {"x": {"type": "number"}}, "nullable": True},
                ],
            },
            "mode": {
                "oneOf": [{"type": "string", "enum": ["fast", "slow"], "default": "fast"}, {"type": "boolean"}],
                "default": "fast",
            },
        },
    },
]
TEXTS = [
    "What is 17 * 23?",
    "Weather in Tokyo? <|end|> café",
    "naïve Zürich 数学 😀 ∑ π≈3.14",
    "Line one\nLine two\n\n  indented",
    "",
    " leading and trailing spaces ",
    '{"json": [1, 2, 3]}',
    "print(sum(i*i for i in range(10)))",
    "a" * 40,
    "Tab\tseparated\r\nwindows line",
]


def _tools(rng):
    count = rng.randint(0, 3)
    names = rng.sample(["get_weather", "python_exec", "lookup", "calc", "search_docs"], count)
    return [
        {
            "name": n,
            "description": rng.choice(["Does a thing.", "Line 1.\nLine 2.", ""]),
            "parameters": rng.choice(SCHEMAS),
        }
        for n in names
    ]


def _system(rng):
    return SystemContent(
        model_identity=rng.choice(
            [None, "You are ChatGPT, a large language model trained by OpenAI.", "You are a careful math tutor."]
        ),
        reasoning_effort=rng.choice([None, "low", "medium", "high"]),
        knowledge_cutoff=rng.choice([None, "2024-06"]),
        conversation_start_date=rng.choice([None, "2025-06-28"]),
        valid_channels=rng.choice([("analysis", "commentary", "final"), ("analysis", "final"), ()]),
        channel_required=rng.random() < 0.8,
    )


def _assistant_turn(rng, tools, turn):
    msgs = []
    if rng.random() < 0.7:
        msgs.append({"role": "assistant", "channel": "analysis", "content": rng.choice(TEXTS) or "thinking"})
    for _ in range(rng.randint(0, 2) if tools else 0):
        tool = rng.choice(tools)["name"]
        ctype = rng.choice(["<|constrain|>json", "json", None])
        msgs.append(
            {
                "role": "assistant",
                "channel": "commentary",
                "recipient": f"functions.{tool}",
                "content_type": ctype,
                "content": f'{{"location": "Paris", "n": {turn}}}',
            }
        )
        msgs.append({"role": "tool", "name": tool, "content": rng.choice(TEXTS) or "{}"})
    if rng.random() < 0.2:
        msgs.append(
            {
                "role": "assistant",
                "channel": "analysis",
                "recipient": "python",
                "content_type": "code",
                "content": "print(1 + 1)",
            }
        )
        msgs.append({"role": "tool", "name": "python", "content": "2\n"})
    msgs.append(
        {
            "role": "assistant",
            "channel": rng.choice(["final", "final", "commentary"]),
            "content": rng.choice(TEXTS) or "Done.",
        }
    )
    return msgs


def random_conversation(seed: int) -> dict:
    """Arguments for ``render_conversation``: conversation, tools, system, python_tool."""
    rng = random.Random(seed)
    tools = _tools(rng)
    convo = []
    if rng.random() < 0.6:
        convo.append({"role": "system", "content": rng.choice(["Be brief.", "Answer in French.\nUse tools."])})
    for turn in range(rng.randint(1, 3)):
        convo.append({"role": "user", "content": rng.choice(TEXTS) or "hi"})
        if rng.random() < 0.85:
            convo.extend(_assistant_turn(rng, tools, turn))
    return {"conversation": convo, "tools": tools, "system": _system(rng), "python_tool": rng.random() < 0.3}


def _namespace_to_harmony(oh, ns: ToolNamespace):
    tools = [oh.ToolDescription.new(t.name, t.description, parameters=t.parameters) for t in ns.tools]
    return oh.ToolNamespaceConfig(name=ns.name, description=ns.description, tools=tools)


def _content_to_harmony(oh, content):
    if isinstance(content, SystemContent):
        sc = oh.SystemContent.new()
        sc.model_identity, sc.knowledge_cutoff = content.model_identity, content.knowledge_cutoff
        sc.conversation_start_date = content.conversation_start_date
        sc.reasoning_effort = (
            oh.ReasoningEffort(content.reasoning_effort.capitalize()) if (content.reasoning_effort) else None
        )
        sc.channel_config = oh.ChannelConfig(
            valid_channels=list(content.valid_channels), channel_required=content.channel_required
        )
        for ns in content.tools:
            sc = sc.with_tools(_namespace_to_harmony(oh, ns))
        return sc
    if isinstance(content, DeveloperContent):
        dc = oh.DeveloperContent.new()
        if content.instructions is not None:
            dc = dc.with_instructions(content.instructions)
        for ns in content.tools:
            dc = dc.with_tools(_namespace_to_harmony(oh, ns))
        return dc
    return content


def to_harmony_messages(oh, messages: list[Message]):
    out = []
    for m in messages:
        role = oh.Role(m.role)
        author = oh.Author.new(role, m.name) if m.name else oh.Author(role=role)
        msg = oh.Message.from_author_and_content(author, _content_to_harmony(oh, m.content))
        if m.channel is not None:
            msg = msg.with_channel(m.channel)
        if m.recipient is not None:
            msg = msg.with_recipient(m.recipient)
        if m.content_type is not None:
            msg = msg.with_content_type(m.content_type)
        out.append(msg)
    return out


def reference_messages(case: dict) -> list[Message]:
    return build_messages(
        case["conversation"], tools=case["tools"], system=case["system"], python_tool=case["python_tool"]
    )
