"""The checks every reward value passes, in training and in evaluation alike (``checked_reward``).

A reward function returns one value per completion; each is coerced with ``float()`` and must be finite and at
most ``LARGEST_REWARD`` in magnitude (``None`` marks a completion the function cannot score). A wrong length, a
non-number or a non-finite value raises naming the function and the completion, so a broken reward never turns
into a silent advantage.
"""

from __future__ import annotations

import functools
import inspect
import math

# TRL takes group means and standard deviations in float32: squares of rewards much beyond 1e9 lose the
# signal to rounding and overflow (1e20**2 > float32 max), so such a value is a bug in the reward.
LARGEST_REWARD = 1e9


def _coerced(name: str, index: int, reward):
    """``reward`` as a finite float (None stays None: a completion the function cannot score)."""
    if reward is None:
        return None
    if isinstance(reward, (str, bytes, dict, list, tuple, set)):
        raise ValueError(
            f"reward function '{name}' returned {type(reward).__name__} {str(reward)[:60]!r} for completion "
            f"{index}; return a number (or None for a completion it cannot score)"
        )
    try:
        value = float(reward)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"reward function '{name}' returned {type(reward).__name__} for completion {index}, which is not a "
            f"number ({exc}); return a float (or None)"
        ) from None
    if not math.isfinite(value) or abs(value) > LARGEST_REWARD:
        raise ValueError(
            f"reward function '{name}' returned {value!r} for completion {index}; rewards must be finite and "
            f"at most {LARGEST_REWARD:g} in magnitude (return None to mark a completion it cannot score)"
        )
    return value


def _check_rewards(name: str, rewards, expected: int) -> list:
    if rewards is None or isinstance(rewards, (str, bytes, dict)) or not hasattr(rewards, "__len__"):
        raise ValueError(
            f"reward function '{name}' returned {type(rewards).__name__}, expected a list of "
            f"{expected} floats (one per completion)"
        )
    if len(rewards) != expected:
        raise ValueError(
            f"reward function '{name}' returned {len(rewards)} rewards for {expected} completions; "
            "return exactly one per completion (None marks one it cannot score)"
        )
    return [_coerced(name, i, r) for i, r in enumerate(rewards)]


def checked_reward(reward_func):
    """Wrap a callable reward function (sync or async): each value is coerced with ``float()`` and must be
    finite; a wrong length, a non-number or a non-finite value raises naming the function and the completion.

    The wrapper keeps ``__name__`` (TRL logs rewards under it). Model-based rewards are returned unchanged.
    """
    if not callable(reward_func) or not hasattr(reward_func, "__name__") or isinstance(reward_func, type):
        return reward_func
    name = reward_func.__name__

    if inspect.iscoroutinefunction(reward_func):

        @functools.wraps(reward_func)
        async def checked_async(*args, completions, **kwargs):
            rewards = await reward_func(*args, completions=completions, **kwargs)
            return _check_rewards(name, rewards, len(completions))

        return checked_async

    @functools.wraps(reward_func)
    def checked(*args, completions, **kwargs):
        rewards = reward_func(*args, completions=completions, **kwargs)
        return _check_rewards(name, rewards, len(completions))

    return checked
