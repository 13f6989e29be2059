"""The deprecation warning of the modules that moved from ``trl_gptoss.demo`` to ``trl_gptoss.scripts``."""

from __future__ import annotations

import warnings


def warn_moved(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; the old import path will be removed in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
