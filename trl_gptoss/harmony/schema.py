"""JSON schema → the TypeScript-like declarations Harmony puts in the developer message.

Harmony declares a function tool as ``type NAME = (_: {...}) => any;`` with the parameters' JSON schema
written as a TypeScript object type: descriptions become ``//`` comments, optional keys get ``?``, enums become
string-literal unions, ``integer`` becomes ``number``, ``oneOf`` becomes an indented ``|`` list and defaults
trail as ``// default: ...``. The layout (indentation, where comments go) follows openai-harmony 0.0.8
exactly, because the model was trained on it; tests compare token ids against that package.
"""

from __future__ import annotations

import json


def _json_text(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _is_enum(schema) -> bool:
    return isinstance(schema.get("enum"), list) and bool(schema["enum"])


def _default_comment(schema) -> str | None:
    """``default: "x"`` for plain strings, ``default: x`` for enum strings, JSON text otherwise."""
    if "default" not in schema:
        return None
    default = schema["default"]
    if isinstance(default, str):
        return f'default: "{default}"' if not _is_enum(schema) else f"default: {default}"
    return f"default: {_json_text(default)}"


def _with_nullable(schema, type_text: str) -> str:
    if schema.get("nullable") is True and "null" not in type_text:
        return f"{type_text} | null"
    return type_text


def _trailing(comments) -> str:
    comments = [c for c in comments if c]
    return f" // {' '.join(comments)}" if comments else ""


def _top_level_one_of(variants, indent: str) -> str:
    out = []
    for variant in variants:
        type_text = _with_nullable(variant, schema_to_typescript(variant, indent + "   "))
        description = variant.get("description") if isinstance(variant.get("description"), str) else None
        out.append(f"\n{indent} | {type_text}{_trailing([description, _default_comment(variant)])}")
    return "".join(out)


def _property_one_of(key, prop, variants, required, indent: str) -> str:
    prop_desc = prop.get("description") if isinstance(prop.get("description"), str) else None
    first_desc = variants[0].get("description") if variants else None
    desc_above = prop_desc is not None and prop_desc != first_desc
    lines = f"{indent}// {prop_desc}\n" if desc_above else ""
    default = _default_comment(prop)
    if default is not None:
        lines += f"{indent}// {default}\n"
    lines += f"{indent}{key}{'' if key in required else '?'}:\n"
    for i, variant in enumerate(variants):
        type_text = _with_nullable(variant, schema_to_typescript(variant, indent + "   "))
        description = variant.get("description")
        keep_desc = not (i == 0 and desc_above) and isinstance(description, str) and description != prop_desc
        comments = [description if keep_desc else None, _default_comment(variant)]
        lines += f"{indent} | {type_text}{_trailing(comments)}\n"
    return lines + f"{indent},\n"


def _property_comments(prop, indent: str) -> str:
    lines = ""
    if isinstance(prop.get("title"), str):
        lines += f"{indent}// {prop['title']}\n{indent}//\n"
    if "oneOf" not in prop and isinstance(prop.get("description"), str):
        lines += f"{indent}// {prop['description']}\n"
    examples = prop.get("examples")
    if isinstance(examples, list) and examples:
        lines += f"{indent}// Examples:\n"
        lines += "".join(f'{indent}// - "{ex}"\n' for ex in examples if isinstance(ex, str))
    return lines


def _object(schema, indent: str) -> str:
    out = f"{indent}// {schema['description']}\n" if isinstance(schema.get("description"), str) else ""
    out += "{\n"
    props = schema.get("properties")
    required_list = schema.get("required") if isinstance(schema.get("required"), list) else []
    required = {r for r in required_list if isinstance(r, str)}
    for key, prop in props.items() if isinstance(props, dict) else ():
        prop = prop if isinstance(prop, dict) else {}
        out += _property_comments(prop, indent)
        if isinstance(prop.get("oneOf"), list):
            out += _property_one_of(key, prop, prop["oneOf"], required, indent)
            continue
        type_text = _with_nullable(prop, schema_to_typescript(prop, indent + "    "))
        default = None if "oneOf" in prop else _default_comment(prop)
        out += f"{indent}{key}{'' if key in required else '?'}: {type_text},"
        out += f" // {default}" if default is not None else ""
        out += "\n"
    return out + f"{indent}}}"


def _string(schema) -> str:
    enum = schema.get("enum")
    if isinstance(enum, list):
        literals = [f'"{value}"' for value in enum if isinstance(value, str)]
        if literals:
            return " | ".join(literals)
    return "string"


def schema_to_typescript(schema: dict, indent: str = "") -> str:
    """Render one JSON schema node; ``indent`` is the indentation of nested object members."""
    if not isinstance(schema, dict):
        return "any"
    if isinstance(schema.get("oneOf"), list):
        return _top_level_one_of(schema["oneOf"], indent)
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if k == "integer" else k for k in kind if isinstance(k, str)]
        if names:
            return " | ".join(names)
        kind = None
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        return _string(schema)
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return f"{schema_to_typescript(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"
