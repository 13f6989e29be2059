"""Checks of single config values, each rule written once and shared by every place that needs it.

Every error names the field and says what to change. ``bool`` is refused wherever a number is expected:
YAML's ``max_turns: true`` would otherwise pass as ``1``.
"""

from __future__ import annotations

import math
import reprlib

# TRL 1.16's GRPO losses (``GRPOTrainer._compute_loss``); an unknown name fails there only at the first step.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")

# GPT-OSS's context (``max_position_embeddings``): no completion or served context can be longer.
MAX_CONTEXT_TOKENS = 131_072

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 120, 120, 40
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 8
_MOST_SHOWN = 240


def shown(value) -> str:
    """``repr(value)`` cut to a few lines whatever its size: an error message echoes what it refuses, and a YAML
    alias bomb or a megabyte string must not become the message."""
    text = _SHOWN.repr(value)
    return text if len(text) <= _MOST_SHOWN else f"{text[:_MOST_SHOWN]}..."


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(name: str, value, *, minimum: int = 1, maximum: int | None = None, allow_none=False) -> None:
    """``value`` is an int in [``minimum``, ``maximum``] (or None when allowed); ``bool`` is not an int here."""
    if value is None and allow_none:
        return
    in_range = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    if not in_range or (maximum is not None and value > maximum):
        none = " or null" if allow_none else ""
        most = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{most}{none}, got {shown(value)}")


def finite_number(
    name: str, value, *, low=None, high=None, low_open=False, high_open=False, allow_inf=False, allow_none=False
) -> None:
    """``value`` is a finite number in [low, high] (either end open with ``low_open`` / ``high_open``); NaN never
    passes, ``+inf`` only with ``allow_inf`` (a bound that turns something off, e.g. no gradient clipping)."""
    if value is None and allow_none:
        return
    if not _is_number(value) or math.isnan(value) or (math.isinf(value) and not (allow_inf and value > 0)):
        kind = "a number (finite or .inf)" if allow_inf else "a finite number"
        raise ValueError(f"{name} must be {kind}, got {shown(value)}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lower = f"{name} {'>' if low_open else '>='} {low}" if low is not None else ""
        upper = f"{name} {'<' if high_open else '<='} {high}" if high is not None else ""
        raise ValueError(f"{name} must satisfy {' and '.join(filter(None, (lower, upper)))}, got {shown(value)}")


def finite_numbers(name: str, values, *, allow_none: bool = False) -> None:
    """``values`` is a list of finite numbers (or None when allowed)."""
    if values is None and allow_none:
        return
    if not isinstance(values, (list, tuple)) or not all(_is_number(v) and math.isfinite(v) for v in values):
        raise ValueError(f"{name} must be a list of finite numbers, got {shown(values)}")


def one_of(name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={shown(value)}; choose one of {sorted(choices)}")


def registered(name: str, value, interface, extra=("eager",)) -> None:
    """``value`` is registered with a transformers interface (attention or experts)."""
    known = set(interface.valid_keys()) | set(extra)
    if value not in known:
        raise ValueError(
            f"{name}={shown(value)} is not registered with transformers (known: {sorted(known)}); "
            "import the package that registers it before building the config"
        )
