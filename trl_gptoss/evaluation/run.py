"""Evaluate held-out problems: ``k`` rollouts each, graded by the task's reward, summarised per task and overall.

The rollouts come from a ``sample(prompts) -> rollouts`` callable, so the trainer's ``Sampler`` (the weights of the
step it reports, never disturbing the training schedule) and ``trl-gptoss eval`` (a server started or given) run
the same code. All ``problems x k`` conversations are handed over at once: the rollout loop keeps them in flight
together, tool calls included.

A sample is correct when its reward reaches ``CORRECT_REWARD`` (1: ReTool's +1, GSM8K's 1, VerifyIf's all
constraints met). Rewards pass the checks training applies to them (``trl_gptoss.rewards.checked.checked_reward``:
one number per completion, finite, not a string; None marks a completion the function cannot score). A reward
function that raises or returns what those checks refuse makes that sample wrong, and the error -- naming the
function -- is reported with the problem (``reward_errors``), never dropped and never counted as right.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from trl_gptoss.evaluation.metrics import accuracy_metrics
from trl_gptoss.rewards.checked import checked_reward

CORRECT_REWARD = 1.0

# Size limits of one evaluation, with the reasons the commands that check them give.
MAX_K = 1024
MAX_K_REASON = (
    "more samples per problem add nothing the standard error over problems can resolve (the retrospective's "
    "mean@30 used 30), and each problem's samples are held and graded together"
)
MAX_PROBLEMS = 100_000
MAX_CONVERSATIONS = 1 << 18
MAX_CONVERSATIONS_REASON = (
    "every problem x k conversation is handed to the rollout loop at once (one task, prompt and open request each)"
)


@dataclass
class Grader:
    """How one task's samples are graded: ``reward`` (TRL's signature, called with one completion and the
    row's columns) and, for maj@k, ``answer(text) -> str | None`` with ``same(a, b)`` (None: no final answers
    to vote on)."""

    task: str
    reward: Callable[..., list]
    answer: Callable[[str], object] | None = None
    same: Callable[[object, object], bool] | None = None


@dataclass
class ProblemResult:
    """One problem's ``k`` samples (lists aligned by sample)."""

    task: str
    problem: int  # the row's index in the evaluation set
    prompt: object
    final_answers: list = field(default_factory=list)
    answers: list = field(default_factory=list)  # what the task's extractor read (maj@k votes)
    rewards: list = field(default_factory=list)
    correct: list = field(default_factory=list)
    tool_calls: list = field(default_factory=list)
    turns: list = field(default_factory=list)
    stop_reasons: list = field(default_factory=list)
    reward_errors: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_rows(
    sample, rows: Sequence[dict], graders: dict[str, Grader], k: int, default_task: str, on_problem=None
) -> list:
    """``rows``: dicts with a ``prompt`` and the reward's ground-truth columns (and optionally ``task``, naming a
    grader; else ``default_task``). Returns one ``ProblemResult`` per row, in order. Every row's task is checked
    before anything is sampled.

    ``on_problem(result)``: called with each problem's result as soon as its ``k`` samples are graded; ``sample``
    is then called as ``sample(prompts, on_rollout)`` and must call ``on_rollout(index, rollout)`` as each
    conversation ends (``trl-gptoss eval`` writes each problem out as it finishes)."""
    if k < 1:
        raise ValueError(f"k (samples per problem) must be >= 1, got {k}")
    tasks = [_task_of(row, index, graders, default_task) for index, row in enumerate(rows)]
    checked = {name: checked_reward(grader.reward) for name, grader in graders.items()}

    def grade(index: int, rollouts: Sequence) -> ProblemResult:
        row, task = rows[index], tasks[index]
        result = ProblemResult(task=task, problem=row.get("problem", index), prompt=row["prompt"])
        for rollout in rollouts:
            _grade(result, rollout, row, graders[task], checked[task])
        return result

    prompts = [row["prompt"] for row in rows for _ in range(k)]
    graded: dict[int, ProblemResult] = {}
    if not prompts:
        rollouts = []
    elif on_problem is None:
        rollouts = sample(prompts)
    else:
        finished: dict[int, dict[int, object]] = {}

        def on_rollout(index: int, rollout) -> None:
            samples = finished.setdefault(index // k, {})
            samples[index % k] = rollout
            if len(samples) == k:
                graded[index // k] = grade(index // k, [samples[j] for j in range(k)])
                on_problem(graded[index // k])

        rollouts = sample(prompts, on_rollout)
    if len(rollouts) != len(prompts):
        raise RuntimeError(f"the sampler returned {len(rollouts)} rollouts for {len(prompts)} prompts")
    return [graded.get(i) or grade(i, rollouts[i * k : (i + 1) * k]) for i in range(len(rows))]


def _task_of(row: dict, index: int, graders: dict[str, Grader], default_task: str) -> str:
    task = row.get("task") or default_task
    if task not in graders:
        raise ValueError(f"evaluation row {index} names task {task!r}; graders exist for {sorted(graders)}")
    return task


# What a reward function receives beside the row's columns, as in training (``GptOssGRPOTrainer``'s columns).
ROLLOUT_FIELDS = ("final_answer", "messages", "num_turns", "num_tool_calls", "num_tool_errors", "stop_reason")


def _grade(result: ProblemResult, rollout, row: dict, grader: Grader, reward_func) -> None:
    text = rollout.final_answer or ""
    columns = {name: [value] for name, value in row.items() if name not in ("prompt", "task", "problem")}
    columns.update({name: [getattr(rollout, name)] for name in ROLLOUT_FIELDS})
    completion = [[{"role": "assistant", "content": text}]]
    try:
        (reward,) = reward_func(
            prompts=[row["prompt"]], completions=completion, completion_ids=[rollout.completion_ids], **columns
        )
        error = None
    except Exception as exc:  # a crashing or refused reward makes this sample wrong, reported with the problem
        reward, error = None, f"{type(exc).__name__}: {exc}"
    result.final_answers.append(rollout.final_answer)
    result.answers.append(grader.answer(text) if grader.answer is not None and rollout.final_answer else None)
    result.rewards.append(reward)
    result.correct.append(reward is not None and reward >= CORRECT_REWARD)
    result.tool_calls.append(rollout.num_tool_calls)
    result.turns.append(rollout.num_turns)
    result.stop_reasons.append(rollout.stop_reason)
    result.reward_errors.append(error)


def summarize(results: Sequence[ProblemResult], graders: dict[str, Grader], seconds: float | None = None) -> dict:
    """Metrics per task (``<task>/<metric>``) and over all problems (``<metric>``; maj@k only when every task
    has answers to vote on): accuracy (``accuracy_metrics``), ``reward`` (mean over samples), ``tool_calls`` and
    ``turns`` per episode, ``truncated`` (share of samples cut by the token budget), ``reward_errors``
    (samples whose reward raised), ``problems``, ``samples``, ``seconds``."""
    if not results:
        raise ValueError("no problems were evaluated")
    metrics = {}
    tasks = sorted({r.task for r in results})
    for task in tasks:
        mine = [r for r in results if r.task == task]
        metrics.update({f"{task}/{name}": value for name, value in _metrics(mine, graders[task].same).items()})
    sames = {graders[t].same for t in tasks}  # over all problems, maj@k needs one answer comparison
    metrics.update(_metrics(results, sames.pop() if len(sames) == 1 else None))
    if seconds is not None:
        metrics["seconds"] = seconds
    return metrics


def _metrics(results: Sequence[ProblemResult], same) -> dict:
    def flat(name: str) -> list:
        return [value for r in results for value in getattr(r, name)]

    samples = len(flat("correct"))
    rewards = [r for r in flat("rewards") if r is not None]
    metrics = accuracy_metrics(results, same)
    metrics.update(
        reward=sum(rewards) / len(rewards) if rewards else float("nan"),
        tool_calls=sum(flat("tool_calls")) / samples,
        turns=sum(flat("turns")) / samples,
        truncated=sum(s == "length" for s in flat("stop_reasons")) / samples,
        reward_errors=float(sum(e is not None for e in flat("reward_errors"))),
        problems=float(len(results)),
        samples=float(samples),
    )
    return metrics


def timed(function, *args, **kwargs):
    """``(function(*args, **kwargs), seconds)``."""
    start = time.perf_counter()
    value = function(*args, **kwargs)
    return value, time.perf_counter() - start
