"""Shared pieces of the rollout-loop tests: small function tools and a scripted-rollout builder."""

from __future__ import annotations

from trl_gptoss.harmony import SystemContent, ToolNamespace, render_conversation
from trl_gptoss.testing.engines import ScriptedEngine, harmony_ids
from trl_gptoss.tools import Tool, ToolResult


def ok_result(text: str) -> ToolResult:
    return ToolResult(
        stdout=text, stderr="", exit_code=0, timed_out=False, truncated=False, wall_time=0.0, isolation="none"
    )


class AddTool(Tool):
    name = "add"
    description = "Add two integers."
    parameters = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }

    def _invoke(self, arguments: dict) -> ToolResult:
        return ok_result(str(arguments["a"] + arguments["b"]))


class MissingFileTool(Tool):
    """Raises a real ``OSError`` (a file that is not there), as a sandbox that cannot start would."""

    name = "read_log"
    description = "Read the training log."
    parameters = {"type": "object", "properties": {}}

    def _invoke(self, arguments: dict) -> ToolResult:
        with open("/nonexistent-trl-gptoss-dir/log.txt") as handle:
            return ok_result(handle.read())


class BrokenTool(Tool):
    name = "broken"
    description = "Always fails."
    parameters = {"type": "object", "properties": {}}

    def _invoke(self, arguments: dict) -> ToolResult:
        raise RuntimeError("disk on fire")


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def add_call(a: int, b: int, *, order: int = 1) -> str:
    """One assistant turn's text ending in a call to functions.add, in either Harmony header order."""
    body = f'{{"a": {a}, "b": {b}}}'
    if order == 1:
        return (
            f"<|channel|>commentary<|message|>Adding.<|end|><|start|>assistant to=functions.add"
            f"<|channel|>commentary <|constrain|>json<|message|>{body}<|call|>"
        )
    return f"<|channel|>commentary to=functions.add <|constrain|>json<|message|>{body}<|call|>"


def final(text: str) -> str:
    return (
        f"<|channel|>analysis<|message|>Done thinking.<|end|><|start|>assistant<|channel|>final<|message|>"
        f"{text}<|return|>"
    )


def declared_prompt_ids(tokenizer, prompt, tools=()) -> list[int]:
    """A prompt rendered with each tool declared by its own settings: a builtin (``builtin_name``) as a
    system-message namespace with the tool's description, every other tool as ``functions.NAME``."""
    builtins = tuple(ToolNamespace(t.builtin_name, t.description) for t in tools if t.builtin_name)
    system = SystemContent(tools=builtins)
    functions = [t for t in tools if not t.builtin_name]
    return render_conversation(prompt, tokenizer, tools=functions, system=system, add_generation_prompt=True)


def scripted(
    tokenizer, conversations: list[tuple[list[dict], list[str]]], *, tools=(), **engine_kwargs
) -> ScriptedEngine:
    """An engine whose conversation ``i`` (prompt ``conversations[i][0]``) samples the turns ``[i][1]``."""
    scripts = {}
    for prompt, turns in conversations:
        ids = declared_prompt_ids(tokenizer, prompt, tools)
        scripts[tuple(ids)] = [harmony_ids(tokenizer, turn) for turn in turns]
    return ScriptedEngine(tokenizer, scripts, **engine_kwargs)
