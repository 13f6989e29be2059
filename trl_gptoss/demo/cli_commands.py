"""Deprecated alias of ``trl_gptoss.scripts.cli_commands`` (removed in the next release)."""

from trl_gptoss.demo._moved import warn_moved
from trl_gptoss.scripts.cli_commands import register  # noqa: F401

warn_moved(__name__, "trl_gptoss.scripts.cli_commands")
