"""Input checks that fail before (or instead of) silently wrong training: dataset rows and reward outputs."""

from __future__ import annotations

import functools
import inspect
import math

from trl_gptoss.trainer.rollouts import ROLLOUT_COLUMNS

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


def as_conversation(prompt):
    """TRL's "standard" (plain-text) prompt becomes one user message; conversations stay as they are."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _check_prompt(prompt, where: str) -> None:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: field 'prompt' is an empty string")
        return
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    ):
        raise ValueError(
            f"{where}: field 'prompt' must be text or a non-empty list of {{'role', 'content'}} messages, "
            f"got {str(prompt)[:120]!r}"
        )


def check_dataset(dataset, required: list[str], name: str = "train_dataset") -> None:
    """Raise ``ValueError`` naming the first row and field that is missing or empty.

    ``prompt`` is text (one user message, TRL's "standard" format) or a non-empty list of ``{"role",
    "content"}`` messages (TRL's conversational format); every column in ``required`` must be present and not
    ``None``. A dataset without rows is refused; an iterable (streamed) dataset has its columns checked, and
    its rows as TRL reads them.
    """
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    for field in ["prompt", *required]:
        if columns is not None and field not in columns:
            raise ValueError(f"{name} has no '{field}' column (columns: {columns}); every row needs a '{field}'")
    if not hasattr(dataset, "__len__"):
        return  # streamed: reading it here would consume or download it
    if len(dataset) == 0:
        raise ValueError(f"{name} has no rows: there is nothing to train on")
    for index in range(len(dataset)):
        row = dataset[index]
        for field in ["prompt", *required]:
            if row.get(field) is None:
                raise ValueError(f"{name} row {index} is missing field '{field}'")
        _check_prompt(row["prompt"], f"{name} row {index}")


# TRL takes group means and standard deviations in float32: squares of rewards much beyond 1e9 lose the
# signal to rounding and overflow (1e20**2 > float32 max), so such a value is a bug in the reward.
_LARGEST_REWARD = 1e9


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
    if not math.isfinite(value) or abs(value) > _LARGEST_REWARD:
        raise ValueError(
            f"reward function '{name}' returned {value!r} for completion {index}; rewards must be finite and "
            f"at most {_LARGEST_REWARD:g} in magnitude (return None to mark a completion it cannot score)"
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


def check_world(num_processes: int, environ=None) -> None:
    """Refuse a launcher world that accelerate does not see: ``torchrun``/``accelerate launch`` set
    ``WORLD_SIZE`` for every process, but accelerate 1.15 picks a distributed type only for accelerator
    backends, so on a CPU host without ``--cpu``/``use_cpu`` each process trains alone (``DistributedType.NO``)
    -- N unsynchronised copies that all act as the main process, with no error."""
    import os

    environ = os.environ if environ is None else environ
    launched = int(environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and num_processes == 1:
        raise ValueError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but accelerate sees 1: each would "
            "train its own copy without synchronising. On a CPU host set use_cpu=True (accelerate launch --cpu "
            "runs machines apart: use the FSDP/multi-GPU config on GPUs), or launch a single process"
        )


def reward_weights_problem(weights, reward_names: list[str]) -> str | None:
    """Why ``reward_weights`` cannot weight the reward functions ``reward_names``, or None (no weights: TRL
    weighs each 1.0). The job's config check and the library trainer share it; TRL itself raises on the count
    only once the model has loaded."""
    if weights is None or len(weights) == len(reward_names):
        return None
    functions = f"{len(reward_names)} reward function{'s' if len(reward_names) != 1 else ''}"
    return (
        f"reward_weights has {len(weights)} weights, but there {'is' if len(reward_names) == 1 else 'are'} "
        f"{functions} ({', '.join(reward_names)}): give one weight per function, in their order, or drop "
        "reward_weights"
    )


def reward_name(reward_func) -> str:
    """The name TRL logs a reward under: a function's ``__name__``, a reward model's config name."""
    if hasattr(reward_func, "__name__"):
        return reward_func.__name__
    name = getattr(getattr(reward_func, "config", None), "_name_or_path", None)
    return str(name).split("/")[-1] if name else str(reward_func)


def checked_rewards(reward_funcs, train_dataset, eval_dataset=None, weights=None) -> list | None:
    """The trainer's reward functions as a list, each wrapped by ``checked_reward``, after checking that the
    datasets have every column they take beyond what rollouts supply and that ``weights`` (``reward_weights``)
    has one weight per function. Evaluation rows that name a ``task`` are graded by that task's reward instead,
    so their columns are the task's affair."""
    if reward_funcs is None:
        return None
    reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    if problem := reward_weights_problem(weights, [reward_name(f) for f in reward_funcs]):
        raise ValueError(problem)
    required = sorted({c for f in reward_funcs for c in required_reward_columns(f)} - set(ROLLOUT_COLUMNS))
    check_dataset(train_dataset, required)
    named = eval_dataset.items() if isinstance(eval_dataset, dict) else [("", eval_dataset)]
    for name, dataset in named:
        if dataset is not None and "task" not in (getattr(dataset, "column_names", None) or []):
            check_dataset(dataset, required, name=f"eval_dataset{f'[{name!r}]' if name else ''}")
    return [checked_reward(f) for f in reward_funcs]
