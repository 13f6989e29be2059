"""Checks of single config values, each rule written once and shared by every place that needs it.

Every error names the field and says what to change. ``bool`` is refused wherever a number is expected:
YAML's ``max_turns: true`` would otherwise pass as ``1``.
"""

from __future__ import annotations

import math
from urllib.parse import urlsplit

# TRL 1.16's GRPO losses (``GRPOTrainer._compute_loss``); an unknown name fails there only at the first step.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(name: str, value, *, minimum: int = 1, allow_none: bool = False) -> None:
    """``value`` is an int >= ``minimum`` (or None when allowed)."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        none = " or null" if allow_none else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{none}, got {value!r}")


def finite_number(name: str, value, *, low=None, high=None, low_open=False, allow_none=False) -> None:
    """``value`` is a finite number in [low, high] (``(low, high]`` with ``low_open``)."""
    if value is None and allow_none:
        return
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must lie in {bracket}{low}, {high}], got {value!r}")


def server_url(name: str, url) -> None:
    """An ``http(s)://host[:port][/path]`` URL with a host and, if given, a valid port."""
    if not isinstance(url, str):
        raise ValueError(f"{name} must be a URL string such as http://127.0.0.1:8000, got {url!r}")
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ValueError(f"{name} entry {url!r} is not an http(s)://HOST[:PORT] URL (e.g. http://127.0.0.1:8000)")


def one_of(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; choose one of {sorted(choices)}")


def registered(name: str, value, interface, extra=("eager",)) -> None:
    """``value`` is registered with a transformers interface (attention or experts)."""
    known = set(interface.valid_keys()) | set(extra)
    if value not in known:
        raise ValueError(
            f"{name}={value!r} is not registered with transformers (known: {sorted(known)}); "
            "import the package that registers it before building the config"
        )
