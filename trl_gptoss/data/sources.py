"""Where a task's rows come from: the samples shipped in ``trl_gptoss/data/samples``, a JSON-lines file, the Hub.

These readers know a task only by what its ``TASKS`` row gives them (its name, ``format_row``, ``HubDataset``);
``Task.load`` and the loaders by name (``loaders``) call them. Every row is checked when it is read: a bad line, a
missing or null field, or a malformed constraint raises ``ValueError`` naming the file, the line and the field.
Only ``download_hub_rows`` touches the network, and only when the user asks for ``source="hub"``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `datasets` takes ~1 s to import: only the functions that build a Dataset import it
    from datasets import Dataset

SAMPLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "samples")


@dataclass(frozen=True)
class HubDataset:
    """A task's default Hub dataset: ``load_dataset(path, name)``; ``convert`` maps one of its rows to a task
    row (``None`` drops the row)."""

    path: str
    name: str | None
    convert: Callable[[dict], dict | None]


def sample_path(task: str) -> str:
    """The shipped sample file of ``task``: ``samples/<task>.jsonl``."""
    return os.path.join(SAMPLES_DIR, f"{task}.jsonl")


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


def format_rows(format_row: Callable[[dict], dict], path: str) -> list[dict]:
    """Every row of a JSON-lines file through ``format_row``; ``ValueError`` naming ``path:line`` and the field."""
    formatted = []
    for number, row in read_jsonl(path):
        try:
            formatted.append(format_row(row))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    if not formatted:
        raise ValueError(f"{path}: no rows")
    return formatted


def read_rows(
    task: str,
    format_row: Callable[[dict], dict],
    hub: HubDataset | None,
    *,
    source: str = "sample",
    split: str = "train",
    limit: int | None = None,
    hub_id: str | None = None,
    path: str | None = None,
) -> Dataset:
    """The rows of a task read from ``source``: ``"sample"`` (shipped, offline), ``"jsonl"`` (the file at
    ``path``) or ``"hub"`` (``download_hub_rows``); the first ``limit`` of them (``None``: all)."""
    check_limit(limit)
    if source == "hub":
        return download_hub_rows(task, require_hub(task, hub), split=split, limit=limit, hub_id=hub_id)
    if source not in ("sample", "jsonl"):
        raise ValueError(f"source must be 'sample', 'jsonl' or 'hub', got {source!r}.")
    if (source == "jsonl") != (path is not None):
        raise ValueError("give path= exactly when source='jsonl'.")
    from datasets import Dataset

    rows = format_rows(format_row, path if source == "jsonl" else sample_path(task))
    return Dataset.from_list(rows[:limit] if limit is not None else rows)


def download_hub_rows(
    task: str, hub: HubDataset, *, split: str = "train", limit: int | None = None, hub_id: str | None = None
) -> Dataset:
    """Download ``hub`` (or ``hub_id``, in the same row format) and convert its rows (network)."""
    check_limit(limit)
    from datasets import load_dataset  # lazy: only this path may download

    raw = load_dataset(hub_id or hub.path, hub.name if hub_id is None else None, split=split)
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    return convert_rows(task, hub.convert, raw)


def convert_rows(task: str, convert: Callable[[dict], dict | None], rows) -> Dataset:
    """``convert`` over ``rows`` (any iterable of dicts), dropping the rows it maps to ``None``."""
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


def require_hub(task: str, hub: HubDataset | None) -> HubDataset:
    """``hub``, or ``ValueError`` when the task has none."""
    if hub is None:
        raise ValueError(f"task {task!r} has no Hub dataset; use source='sample' or 'jsonl'")
    return hub
