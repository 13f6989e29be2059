"""Types of a YAML config's values, checked against the dataclass fields they set, before any parsing.

``TrlParser`` hands YAML values to argparse as defaults: strings are converted by the field's type (and fail
with argparse's message), everything else reaches the dataclass as is, so ``max_turns: true`` becomes an int
field holding ``True`` and ``tool_names: null`` a list field holding ``None``. ``value_problems`` names each
such key with what to write instead.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import fields

_TRUE_FALSE = {"true", "false", "yes", "no", "t", "f", "y", "n", "1", "0"}  # what HfArgumentParser accepts


def field_types(dataclass_types) -> dict[str, object]:
    """``{field name: resolved type hint}`` over all ``dataclass_types`` (later classes do not override)."""
    hints: dict[str, object] = {}
    for cls in dataclass_types:
        resolved = typing.get_type_hints(cls)
        also = getattr(cls, "YAML_ALSO", {})  # types a field's YAML value may have besides its annotation
        for f in fields(cls):
            hint = resolved.get(f.name, object)
            for kind in also.get(f.name, ()):
                hint = hint | kind
            hints.setdefault(f.name, hint)
    return hints


def value_problems(config: dict, hints: dict[str, object]) -> list[str]:
    """One message per key of ``config`` whose value its field's type cannot hold (unknown keys are skipped:
    the parser reports them with the closest known names)."""
    problems = []
    for key, value in config.items():
        if key in hints and not _fits(value, hints[key]):
            problems.append(f"{key}: {_show(value)} is not {_describe(hints[key])}; {_fix(key, hints[key])}")
    return problems


def _fits(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(hint)
        enums = [a for a in arms if isinstance(a, type) and issubclass(a, enum.Enum)]
        if enums and isinstance(value, str):  # `SchedulerType | str`: the string must name a member
            return any(_scalar_fits(value, e) for e in enums)
        return any(_fits(value, arm) for arm in arms)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin in (list, tuple):  # a scalar of the element type is accepted too (TRL wraps it)
        (element, *_) = typing.get_args(hint) or (object,)
        if isinstance(value, (list, tuple)):
            return all(_fits(v, element) for v in value)
        return _scalar_fits(value, element)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return _scalar_fits(value, hint)


def _scalar_fits(value, hint) -> bool:
    if hint is bool:
        return isinstance(value, bool) or (isinstance(value, str) and value.lower() in _TRUE_FALSE)
    if hint in (int, float):
        if isinstance(value, bool):
            return False
        if isinstance(value, str):
            return _converts(hint, value)
        return isinstance(value, int) or (hint is float and isinstance(value, float))
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in {member.value for member in hint}
    if hint is typing.Any or hint is object or not isinstance(hint, type):
        return True
    return isinstance(value, hint) or not isinstance(value, (bool, int, float, str, list, dict, type(None)))


def _converts(kind, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        enums = [a for a in arms if isinstance(a, type) and issubclass(a, enum.Enum)]
        described = " or ".join(dict.fromkeys(_describe(a) for a in enums or arms))  # enum | str: the members
        return described + (" or null" if type(None) in typing.get_args(hint) else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if origin in (list, tuple):
        (element, *_) = typing.get_args(hint) or (object,)
        plural = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}
        return f"a list of {plural.get(element, _describe(element))}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in hint)
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _fix(key: str, hint) -> str:
    origin = typing.get_origin(hint)
    arms = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    if any(typing.get_origin(a) in (list, tuple) for a in arms):
        return f"write a YAML list, e.g. `{key}: []` or `{key}: [a, b]`"
    if any(isinstance(a, type) and issubclass(a, enum.Enum) for a in arms):
        return "pick one of those names"
    if str in arms:
        return f'quote the value (`{key}: "..."`)'
    return f"write {_describe(hint)} (or remove `{key}` to keep its default)"


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    from trl_gptoss.trainer.fields import shown

    return shown(value)  # cut to a line: the value may be a megabyte string
