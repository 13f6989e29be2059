"""Task datasets as ``datasets.Dataset`` in TRL's conversational prompt format.

``load_task_dataset(task)`` reads the small samples shipped in ``trl_gptoss/data/samples`` (offline; used
by tests and examples). ``load_hub_task_dataset(task)`` downloads the real training set from the Hugging
Face Hub; it is only called when the user asks for it (``source="hub"``) and imports ``load_dataset``
lazily, so nothing here touches the network by default.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from trl_gptoss.data import formats

if TYPE_CHECKING:  # `datasets` takes ~1 s to import: only the functions that build a Dataset import it
    from datasets import Dataset

SAMPLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "samples")
TASKS = ("retool", "gsm8k", "verifyif")
HUB_DATASETS = {
    # ReTool's RL stage trains on DAPO-Math-17k (integer answers) with a code interpreter.
    "retool": {"path": "BytedTsinghua-SIA/DAPO-Math-17k", "name": None},
    "gsm8k": {"path": "openai/gsm8k", "name": "main"},
    # Rule-verifiable instructions; rows using instructions without a checker here are dropped.
    "verifyif": {"path": "google/IFEval", "name": None},
}


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"Unknown task {task!r}; choose one of {TASKS}.")


def read_samples(task: str) -> list[dict]:
    """The raw rows of the shipped sample file ``samples/<task>.jsonl``."""
    _check_task(task)
    with open(os.path.join(SAMPLES_DIR, f"{task}.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _format_sample(task: str, row: dict) -> dict:
    if task == "retool":
        return formats.retool_row(row["question"], row["answer"])
    if task == "gsm8k":
        return formats.gsm8k_row(row["question"], row["answer"])
    return formats.verifyif_row(row["instruction"], row["constraints"])


def load_task_dataset(
    task: str,
    source: str = "sample",
    split: str = "train",
    limit: int | None = None,
    hub_id: str | None = None,
) -> Dataset:
    """``Dataset`` with a conversational ``prompt`` column and the reward's ground-truth column.

    Args:
        task: ``"retool"``, ``"gsm8k"`` or ``"verifyif"``.
        source: ``"sample"`` (shipped, offline) or ``"hub"`` (downloads; see ``load_hub_task_dataset``).
        split: Hub split (ignored for samples).
        limit: keep the first ``limit`` rows.
        hub_id: override the Hub dataset id (same row format as the default one).
    """
    _check_task(task)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of rows, got {limit}.")
    if source == "hub":
        return load_hub_task_dataset(task, split=split, limit=limit, hub_id=hub_id)
    if source != "sample":
        raise ValueError(f"source must be 'sample' or 'hub', got {source!r}.")
    from datasets import Dataset

    rows = [_format_sample(task, r) for r in read_samples(task)]
    return Dataset.from_list(rows[:limit] if limit is not None else rows)


def load_hub_task_dataset(
    task: str, split: str = "train", limit: int | None = None, hub_id: str | None = None
) -> Dataset:
    """Download the task's Hub dataset and convert its rows (network; never called by the tests)."""
    _check_task(task)
    from datasets import load_dataset  # lazy: only this path may download

    spec = HUB_DATASETS[task]
    raw = load_dataset(hub_id or spec["path"], spec["name"] if hub_id is None else None, split=split)
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    return convert_hub_rows(task, raw)


def convert_hub_rows(task: str, rows) -> Dataset:
    """Convert Hub rows (any iterable of dicts in the default dataset's format) to task rows."""
    _check_task(task)
    if task == "retool":
        converted = [formats.dapo_math_row(r) for r in rows]
    elif task == "gsm8k":
        converted = [formats.gsm8k_row(r["question"], r["answer"]) for r in rows]
    else:
        converted = [c for c in map(formats.ifeval_row, rows) if c is not None]
    if not converted:
        raise ValueError(f"No {task} rows could be converted; check the dataset's columns.")
    from datasets import Dataset

    return Dataset.from_list(converted)
