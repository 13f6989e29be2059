"""Names that moved into ``trl_gptoss.tools`` and keep working at their old path for one release.

The old modules forward unknown attributes here (``moved_attribute(__name__, name)``), so the table of what
moved lives with the tools that own it. Each access warns with ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import warnings


def _code_from_body(tool, body: str) -> str:
    return tool.code_from_body(body)


# old module -> {old name: (new path shown to the user, module, attribute)}
_MOVED = {
    "trl_gptoss.rollout": {
        "PythonSession": ("trl_gptoss.tools.PythonSession", "trl_gptoss.tools", "PythonSession"),
    },
    "trl_gptoss.rollout.python_session": {
        "PythonSession": ("trl_gptoss.tools.PythonSession", "trl_gptoss.tools", "PythonSession"),
        "notebook_program": (
            "trl_gptoss.tools.python_session.notebook_program",
            "trl_gptoss.tools.python_session",
            "notebook_program",
        ),
        "python_code_from_body": ("trl_gptoss.tools.PythonTool.code_from_body", __name__, "_code_from_body"),
    },
}


def moved_attribute(module: str, name: str):
    """``module.name`` for a name that moved here (with a ``DeprecationWarning``); ``AttributeError`` otherwise."""
    entry = _MOVED.get(module, {}).get(name)
    if entry is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new_path, new_module, attribute = entry
    warnings.warn(
        f"{module}.{name} moved to {new_path}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(new_module), attribute)
