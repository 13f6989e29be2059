"""Deprecated module: the python notebook session moved to ``trl_gptoss.tools`` (``trl_gptoss.tools.moved``
lists the old names, which keep working for one release and warn on access)."""

from __future__ import annotations


def __getattr__(name: str):
    from trl_gptoss.tools.moved import moved_attribute

    return moved_attribute(__name__, name)
