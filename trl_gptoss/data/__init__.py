"""Task datasets (ReTool, GSM8K, VerifyIf, the demo's arithmetic) in TRL's conversational prompt format.

``TASKS`` is the task table (name -> ``Task``: loader, reward, tools it needs, Hub dataset); ``sources`` reads
the offline samples shipped here, a JSON-lines file, or the Hub; ``loaders`` loads a task's rows by its name.

Public names: ``TASKS``, ``Task``, ``HubDataset``, ``get_task``, ``load_task_dataset``, ``load_hub_task_dataset``,
``convert_hub_rows``, ``read_samples``, ``read_jsonl``, ``format_jsonl``, ``describe_constraint``.
"""

from trl_gptoss.data.formats import describe_constraint
from trl_gptoss.data.loaders import (
    convert_hub_rows,
    format_jsonl,
    load_hub_task_dataset,
    load_task_dataset,
    read_samples,
)
from trl_gptoss.data.sources import HubDataset, read_jsonl
from trl_gptoss.data.tasks import TASKS, Task, get_task

__all__ = [
    "TASKS",
    "HubDataset",
    "Task",
    "convert_hub_rows",
    "describe_constraint",
    "format_jsonl",
    "get_task",
    "load_hub_task_dataset",
    "load_task_dataset",
    "read_jsonl",
    "read_samples",
]
