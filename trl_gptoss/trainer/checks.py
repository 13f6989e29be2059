"""Input checks that fail before (or instead of) silently wrong training: dataset rows and reward outputs."""

from __future__ import annotations

import functools
import inspect
import math

_TRL_REWARD_ARGS = {
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
    "environments",
}


def required_reward_columns(reward_func) -> list[str]:
    """Dataset columns a reward function cannot run without: its parameters with no default that TRL does
    not pass itself (TRL passes every dataset column by name)."""
    if not callable(reward_func) or inspect.isclass(reward_func):
        return []
    try:
        params = inspect.signature(reward_func).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.name not in _TRL_REWARD_ARGS
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def check_dataset(dataset, required: list[str], name: str = "train_dataset") -> None:
    """Raise ``ValueError`` naming the first row and field that is missing or empty.

    ``prompt`` must be a non-empty list of ``{"role", "content"}`` messages (TRL's conversational format);
    every column in ``required`` must be present and not ``None``.
    """
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    for field in ["prompt", *required]:
        if columns is not None and field not in columns:
            raise ValueError(f"{name} has no '{field}' column (columns: {columns}); every row needs a '{field}'")
    for index in range(len(dataset)):
        row = dataset[index]
        for field in ["prompt", *required]:
            if row.get(field) is None:
                raise ValueError(f"{name} row {index} is missing field '{field}'")
        prompt = row["prompt"]
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
        ):
            raise ValueError(
                f"{name} row {index}: field 'prompt' must be a non-empty list of "
                f"{{'role', 'content'}} messages, got {str(prompt)[:120]!r}"
            )


def _check_rewards(name: str, rewards, expected: int) -> None:
    if rewards is None or not hasattr(rewards, "__len__"):
        raise ValueError(
            f"reward function '{name}' returned {type(rewards).__name__}, expected a list of "
            f"{expected} floats (one per completion)"
        )
    if len(rewards) != expected:
        raise ValueError(
            f"reward function '{name}' returned {len(rewards)} rewards for {expected} completions; "
            "return exactly one per completion (None marks one it cannot score)"
        )
    for i, reward in enumerate(rewards):
        if reward is not None and isinstance(reward, float) and math.isnan(reward):
            raise ValueError(
                f"reward function '{name}' returned NaN for completion {i}; return None to mark a "
                "completion it cannot score"
            )


def checked_reward(reward_func):
    """Wrap a callable reward function (sync or async) so a wrong length or a NaN raises naming it.

    The wrapper keeps ``__name__`` (TRL logs rewards under it). Model-based rewards are returned unchanged.
    """
    if not callable(reward_func) or not hasattr(reward_func, "__name__") or isinstance(reward_func, type):
        return reward_func
    name = reward_func.__name__

    if inspect.iscoroutinefunction(reward_func):

        @functools.wraps(reward_func)
        async def checked_async(*args, completions, **kwargs):
            rewards = await reward_func(*args, completions=completions, **kwargs)
            _check_rewards(name, rewards, len(completions))
            return rewards

        return checked_async

    @functools.wraps(reward_func)
    def checked(*args, completions, **kwargs):
        rewards = reward_func(*args, completions=completions, **kwargs)
        _check_rewards(name, rewards, len(completions))
        return rewards

    return checked
