"""Task datasets (ReTool, GSM8K, VerifyIf) in TRL's conversational prompt format; offline samples shipped.

Public names: ``load_task_dataset``, ``load_hub_task_dataset``, ``convert_hub_rows``, ``read_samples``,
``read_jsonl``, ``format_jsonl``, ``describe_constraint``, ``TASKS``, ``HUB_DATASETS``.
"""

from trl_gptoss.data.formats import describe_constraint
from trl_gptoss.data.loaders import (
    HUB_DATASETS,
    TASKS,
    convert_hub_rows,
    format_jsonl,
    load_hub_task_dataset,
    load_task_dataset,
    read_jsonl,
    read_samples,
)

__all__ = [
    "HUB_DATASETS",
    "TASKS",
    "convert_hub_rows",
    "describe_constraint",
    "format_jsonl",
    "load_hub_task_dataset",
    "load_task_dataset",
    "read_jsonl",
    "read_samples",
]
