"""The task table: every task the GRPO job trains on, one row each.

``TASKS[name]`` is a ``Task``: how its prompts load (``Task.load``), the reward that scores its completions
(TRL's ``f(completions, **columns) -> list[float]``), the tools a completion must be able to call, and where
its rows come from: shipped samples / JSON-lines files (``format_row``), the Hub (``hub``), or a generator
(``generate``). A new task is one row here plus its reward function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trl_gptoss import rewards
from trl_gptoss.data import formats
from trl_gptoss.data.arithmetic import arithmetic_dataset
from trl_gptoss.data.sources import HubDataset, read_rows

if TYPE_CHECKING:
    from datasets import Dataset


@dataclass(frozen=True)
class Task:
    """One task. Exactly one of ``format_row`` (rows read from files: ``samples/<name>.jsonl`` or a JSON-lines
    file) and ``generate`` (``(num_prompts, seed) -> Dataset``) is set.

    Evaluation: ``answer(text)`` reads a completion's final answer for majority voting (a tuple of answers, or
    None; tasks without one, like VerifyIf, have no maj@k), ``same_answer`` compares two of them. Held-out
    problems come from another seed (generated tasks); when the rows come from the Hub, from the task's held-out
    Hub set if it has one (``eval_hub``, e.g. AIME 2024 for ReTool, split ``eval_split``; or ``eval_split`` of
    ``hub`` itself, e.g. GSM8K's test split); else from rows set aside from the training rows
    (``trl_gptoss.scripts``'s job).
    """

    name: str
    reward: Callable[..., list[float]]
    tools: tuple[str, ...] = ()
    format_row: Callable[[dict], dict] | None = None
    hub: HubDataset | None = None
    generate: Callable[[int, int], Dataset] | None = None
    answer: Callable[[str], tuple | None] | None = None
    eval_split: str | None = None
    eval_hub: HubDataset | None = None

    def __post_init__(self):
        if (self.format_row is None) == (self.generate is None):
            raise ValueError(f"task {self.name!r}: give exactly one of format_row and generate")
        if self.hub is not None and self.format_row is None:
            raise ValueError(f"task {self.name!r}: a Hub dataset needs format_row (its rows are task rows)")

    @property
    def sources(self) -> tuple[str, ...]:
        """The ``source`` values ``load`` accepts."""
        if self.generate is not None:
            return ("generated",)
        return ("sample", "jsonl", "hub") if self.hub is not None else ("sample", "jsonl")

    def load(
        self,
        *,
        source: str | None = None,
        limit: int | None = None,
        hub_id: str | None = None,
        path: str | None = None,
        num_prompts: int = 512,
        seed: int = 0,
        split: str = "train",
    ) -> Dataset:
        """The prompts (TRL conversational ``prompt`` column) and the reward's ground-truth column.

        Generated tasks draw ``num_prompts`` problems from ``seed``; the others read ``source`` (default
        ``"sample"``; see ``load_task_dataset``; ``split``: the Hub's). ``limit`` keeps the first rows in both cases.
        """
        if self.generate is not None:
            if source not in (None, "generated"):
                raise ValueError(f"task {self.name!r} is generated, not read: source must be None, got {source!r}")
            dataset = self.generate(num_prompts, seed)
            return dataset.select(range(min(limit, len(dataset)))) if limit is not None else dataset
        return read_rows(
            self.name,
            self.format_row,
            self.hub,
            source=source or "sample",
            split=split,
            limit=limit,
            hub_id=hub_id,
            path=path,
        )

    @property
    def has_held_out_hub(self) -> bool:
        """Whether the task names a Hub set (or split) of held-out problems, apart from what it trains on."""
        return self.eval_split is not None and (self.eval_hub or self.hub) is not None

    def load_held_out(self, *, limit: int | None = None, hub_id: str | None = None) -> Dataset:
        """The first ``limit`` held-out problems from the Hub: ``eval_hub`` (split ``eval_split``), else split
        ``eval_split`` of ``hub`` (or of ``hub_id``, a training set in ``hub``'s row format)."""
        if not self.has_held_out_hub:
            raise ValueError(f"task {self.name!r} names no held-out Hub set")
        hub, hub_id = (self.eval_hub, None) if self.eval_hub is not None else (self.hub, hub_id)
        return read_rows(
            self.name, self.format_row, hub, source="hub", split=self.eval_split, limit=limit, hub_id=hub_id
        )


def _boxed(text: str) -> tuple | None:
    """ReTool's final answers: every outermost ``\\boxed{}``."""
    return tuple(rewards.boxed_answers(text) or ()) or None


def _marked(text: str) -> tuple | None:
    """GSM8K's final answers: boxed, ``#### x`` or "the answer is x" (what ``gsm8k_reward`` reads)."""
    return tuple(a for a in rewards.marked_answers(text) if a is not None) or None


def same_answer(a: tuple, b: tuple) -> bool:
    """Two final answers are one vote when they state equal values (``answers_match``, element-wise)."""
    return len(a) == len(b) and all(rewards.answers_match(x, y) for x, y in zip(a, b))


def _question_answer(make: Callable[[str, str], dict]) -> Callable[[dict], dict]:
    def format_row(row: dict) -> dict:
        return make(formats.field(row, "question"), formats.field(row, "answer"))

    return format_row


def _aime_row(row: dict) -> dict:
    """An AIME row (``problem``, integer ``answer``: HuggingFaceH4/aime_2024) as a ReTool row."""
    return formats.retool_row(formats.field(row, "problem"), formats.field(row, "answer"))


def _verifyif_row(row: dict) -> dict:
    return formats.verifyif_row(formats.field(row, "instruction"), formats.field(row, "constraints"))


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        # The CPU demo's synthetic ReTool-style task: exact arithmetic only the python tool gets right.
        Task("arithmetic", rewards.retool_reward, tools=("python",), generate=arithmetic_dataset, answer=_boxed),
        # ReTool's RL stage trains on DAPO-Math-17k (integer answers) with a code interpreter.
        Task(
            "retool",
            rewards.retool_reward,
            tools=("python",),
            format_row=_question_answer(formats.retool_row),
            hub=HubDataset("BytedTsinghua-SIA/DAPO-Math-17k", None, formats.dapo_math_row),
            answer=_boxed,
            # held out: the 30 AIME 2024 problems (ReTool reports AIME accuracy), its only split
            eval_hub=HubDataset("HuggingFaceH4/aime_2024", None, _aime_row),
            eval_split="train",
        ),
        Task(
            "gsm8k",
            rewards.gsm8k_reward,
            format_row=_question_answer(formats.gsm8k_row),
            hub=HubDataset("openai/gsm8k", "main", _question_answer(formats.gsm8k_row)),
            answer=_marked,
            eval_split="test",
        ),
        # Rule-verifiable instructions; rows using instructions without a checker here are dropped.
        Task(
            "verifyif",
            rewards.verifyif_reward,
            format_row=_verifyif_row,
            hub=HubDataset("google/IFEval", None, formats.ifeval_row),
        ),
    )
}


def get_task(name: str) -> Task:
    """``TASKS[name]``, or ``ValueError`` listing the task names."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown task {name!r}; choose one of {sorted(TASKS)}") from None
