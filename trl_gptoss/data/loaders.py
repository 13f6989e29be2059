"""Task datasets as ``datasets.Dataset`` in TRL's conversational prompt format.

``load_task_dataset(task)`` reads the small samples shipped in ``trl_gptoss/data/samples`` (offline; used
by tests and examples), or a local JSON-lines file in the same format (``source="jsonl", path=...``).
Every row is checked when it is loaded: a bad line, a missing or null field, or a malformed constraint
raises ``ValueError`` naming the file, the line and the field.

``load_hub_task_dataset(task)`` downloads the real training set from the Hugging
Face Hub; it is only called when the user asks for it (``source="hub"``) and imports ``load_dataset``
lazily, so nothing here touches the network by default.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from trl_gptoss.data.tasks import Task, get_task

if TYPE_CHECKING:  # `datasets` takes ~1 s to import: only the functions that build a Dataset import it
    from datasets import Dataset

SAMPLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "samples")


def _file_task(task: str) -> Task:
    """The row of a task whose rows live in files (all but the generated ones)."""
    spec = get_task(task)
    if spec.format_row is None:
        raise ValueError(
            f"task {task!r} is generated, not read from files; load it with "
            f"trl_gptoss.data.TASKS[{task!r}].load(num_prompts=..., seed=...)"
        )
    return spec


def read_jsonl(path: str) -> list[tuple[int, dict]]:
    """``(line number, row)`` for every non-blank line; ``ValueError`` naming ``path:line`` for a bad one
    (not JSON, not an object, not UTF-8, or nested too deeply for the JSON decoder)."""
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path}:{number}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line); "
                    "re-encode the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc})") from None
            except RecursionError:
                raise ValueError(f"{path}:{number}: JSON nested too deeply for the decoder; flatten the row") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: a row must be a JSON object, got {type(row).__name__}")
            rows.append((number, row))
    return rows


def check_limit(limit) -> None:
    """``limit`` must be ``None`` (every row) or a positive ``int``; a bool is refused, not read as 0 or 1."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int number of rows, or None for every row; got {limit!r}.")


def read_samples(task: str) -> list[dict]:
    """The raw rows of the shipped sample file ``samples/<task>.jsonl``."""
    _file_task(task)
    return [row for _, row in read_jsonl(_sample_path(task))]


def _sample_path(task: str) -> str:
    return os.path.join(SAMPLES_DIR, f"{task}.jsonl")


def format_jsonl(task: str, path: str) -> list[dict]:
    """Every row of a JSON-lines file as a task row; ``ValueError`` naming ``path:line`` and the field."""
    format_row = _file_task(task).format_row
    formatted = []
    for number, row in read_jsonl(path):
        try:
            formatted.append(format_row(row))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    if not formatted:
        raise ValueError(f"{path}: no rows")
    return formatted


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
    _file_task(task)
    check_limit(limit)
    if source == "hub":
        return load_hub_task_dataset(task, split=split, limit=limit, hub_id=hub_id)
    if source not in ("sample", "jsonl"):
        raise ValueError(f"source must be 'sample', 'jsonl' or 'hub', got {source!r}.")
    if (source == "jsonl") != (path is not None):
        raise ValueError("give path= exactly when source='jsonl'.")
    from datasets import Dataset

    rows = format_jsonl(task, path if source == "jsonl" else _sample_path(task))
    return Dataset.from_list(rows[:limit] if limit is not None else rows)


def load_hub_task_dataset(
    task: str, split: str = "train", limit: int | None = None, hub_id: str | None = None
) -> Dataset:
    """Download the task's Hub dataset and convert its rows (network; never called by the tests)."""
    check_limit(limit)
    hub = _hub_dataset(task)
    from datasets import load_dataset  # lazy: only this path may download

    raw = load_dataset(hub_id or hub.path, hub.name if hub_id is None else None, split=split)
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    return convert_hub_rows(task, raw)


def convert_hub_rows(task: str, rows) -> Dataset:
    """Convert Hub rows (any iterable of dicts in the default dataset's format) to task rows."""
    convert = _hub_dataset(task).convert
    converted = []
    for index, row in enumerate(rows):
        try:
            row = convert(row)
        except ValueError as exc:
            raise ValueError(f"{task} Hub row {index}: {exc}") from None
        if row is not None:
            converted.append(row)
    if not converted:
        raise ValueError(f"No {task} rows could be converted; check the dataset's columns.")
    from datasets import Dataset

    return Dataset.from_list(converted)


def _hub_dataset(task: str):
    hub = _file_task(task).hub
    if hub is None:
        raise ValueError(f"task {task!r} has no Hub dataset; use source='sample' or 'jsonl'")
    return hub
