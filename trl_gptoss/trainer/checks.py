"""Input checks that fail before (or instead of) silently wrong training: dataset rows and reward outputs."""

from __future__ import annotations

import inspect

from trl_gptoss.rewards.checked import checked_reward
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
