"""Deprecated alias of ``trl_gptoss.scripts.grpo_summary`` (removed in the next release)."""

from trl_gptoss.demo._moved import warn_moved
from trl_gptoss.scripts.grpo_summary import (  # noqa: F401
    CARD_FIELDS,
    WINDOW,
    finish_run,
    format_summary,
    summarize,
)

warn_moved(__name__, "trl_gptoss.scripts.grpo_summary")
