"""Task datasets by task name, as ``datasets.Dataset`` in TRL's conversational prompt format.

``load_task_dataset(task)`` reads the small samples shipped in ``trl_gptoss/data/samples`` (offline; used
by tests and examples), or a local JSON-lines file in the same format (``source="jsonl", path=...``).
Every row is checked when it is loaded: a bad line, a missing or null field, or a malformed constraint
raises ``ValueError`` naming the file, the line and the field.

``load_hub_task_dataset(task)`` downloads the real training set from the Hugging
Face Hub; it is only called when the user asks for it (``source="hub"``) and imports ``load_dataset``
lazily, so nothing here touches the network by default. The readers themselves live in ``sources``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trl_gptoss.data import sources
from trl_gptoss.data.tasks import Task, get_task

if TYPE_CHECKING:  # `datasets` takes ~1 s to import: only the functions that build a Dataset import it
    from datasets import Dataset


def _file_task(task: str) -> Task:
    """The row of a task whose rows live in files (all but the generated ones)."""
    spec = get_task(task)
    if spec.format_row is None:
        raise ValueError(
            f"task {task!r} is generated, not read from files; load it with "
            f"trl_gptoss.data.TASKS[{task!r}].load(num_prompts=..., seed=...)"
        )
    return spec


def read_samples(task: str) -> list[dict]:
    """The raw rows of the shipped sample file ``samples/<task>.jsonl``."""
    _file_task(task)
    return [row for _, row in sources.read_jsonl(sources.sample_path(task))]


def format_jsonl(task: str, path: str) -> list[dict]:
    """Every row of a JSON-lines file as a task row; ``ValueError`` naming ``path:line`` and the field."""
    return sources.format_rows(_file_task(task).format_row, path)


def load_task_dataset(
    task: str,
    source: str = "sample",
    split: str = "train",
    limit: int | None = None,
    hub_id: str | None = None,
    path: str | None = None,
) -> Dataset:
    """``Dataset`` with a conversational ``prompt`` column and the reward's ground-truth column.

    Args:
        task: a ``TASKS`` name whose rows live in files (``"retool"``, ``"gsm8k"``, ``"verifyif"``).
        source: ``"sample"`` (shipped, offline), ``"jsonl"`` (a local file at ``path`` in the samples'
            format) or ``"hub"`` (downloads; see ``load_hub_task_dataset``).
        split: Hub split (ignored for samples).
        limit: keep the first ``limit`` rows (a positive ``int``; ``None``: all).
        hub_id: override the Hub dataset id (same row format as the default one).
        path: the JSON-lines file for ``source="jsonl"``.
    """
    spec = _file_task(task)
    return sources.read_rows(
        task, spec.format_row, spec.hub, source=source, split=split, limit=limit, hub_id=hub_id, path=path
    )


def load_hub_task_dataset(
    task: str, split: str = "train", limit: int | None = None, hub_id: str | None = None
) -> Dataset:
    """Download the task's Hub dataset and convert its rows (network; never called by the tests)."""
    sources.check_limit(limit)
    return sources.download_hub_rows(task, _hub_dataset(task), split=split, limit=limit, hub_id=hub_id)


def convert_hub_rows(task: str, rows) -> Dataset:
    """Convert Hub rows (any iterable of dicts in the default dataset's format) to task rows."""
    return sources.convert_rows(task, _hub_dataset(task).convert, rows)


def _hub_dataset(task: str) -> sources.HubDataset:
    return sources.require_hub(task, _file_task(task).hub)
