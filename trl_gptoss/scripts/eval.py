"""The ``eval`` subcommand: held-out accuracy of a checkpoint, or of running servers, problem by problem.

``trl-gptoss eval --model PATH | --server URL[,URL] --task NAME [--dataset-source sample|hub|jsonl|generated]
[--dataset-path FILE] [--k 8] [--temperature 0.6] [--max-problems N] [--max-completion-tokens N] [--seed S]
[--output results.json]``

With ``--model`` a vLLM server is started for the checkpoint (and stopped at the end); with ``--server`` the given
ones are used (several: conversations spread over them, ``MultiServerEngine``). Every problem is sampled ``k``
times with the task's tools, all ``problems x k`` conversations in flight together through the rollout loop
(``run_rollouts``), graded by the task's reward (``trl_gptoss.evaluation``), and summarised with the metrics the
trainer logs (mean@k, pass@1, pass@K, maj@k with standard errors, reward, tool calls, turns, truncation, seconds),
per task and overall. ``--output`` writes the settings, the metrics and one record per problem (its id, prompt,
final answers, correctness, rewards and tool calls per sample), so two checkpoints evaluated with the same
settings can be compared problem by problem. Every argument is checked before anything loads; a refusal exits 2
naming what to change.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import sys
from pathlib import Path

# Problems drawn for a generated task when --max-problems is not given.
GENERATED_PROBLEMS = 100
# The progress bar appears once a run has taken this long: short runs print only the table.
PROGRESS_DELAY_S = 5.0
# run_rollouts names the task of conversation i "rollout-<i>" (trl_gptoss.rollout.loop).
CONVERSATION_TASK_PREFIX = "rollout-"


def _task_row(name: str):
    from trl_gptoss.data.tasks import TASKS

    return TASKS.get(name)


def _source(args, task) -> str:
    """``--dataset-source``; default: jsonl with ``--dataset-path``, else "generated" for a generated task and
    "sample" (the shipped rows) for the others."""
    return args.dataset_source or ("jsonl" if args.dataset_path else task.sources[0])


def check_arguments(args) -> list[str]:
    """Every problem of ``args`` that can be seen without loading anything (no server, model or dataset), each
    naming what to change."""
    from trl_gptoss.evaluation.run import MAX_K, MAX_K_REASON, MAX_PROBLEMS

    problems = []
    if isinstance(args.k, bool) or not isinstance(args.k, int) or args.k < 1:
        problems.append(f"--k {args.k}: give the samples per problem, an integer >= 1")
    elif args.k > MAX_K:
        problems.append(f"--k {args.k}: at most {MAX_K} samples per problem: {MAX_K_REASON}")
    if args.max_problems is not None and args.max_problems < 1:
        problems.append(f"--max-problems {args.max_problems}: give a number of problems >= 1 (or leave it out: all)")
    elif args.max_problems is not None and args.max_problems > MAX_PROBLEMS:
        problems.append(
            f"--max-problems {args.max_problems}: at most {MAX_PROBLEMS} problems per run; evaluate a larger set in "
            "parts (--dataset-path files of the parts)"
        )
    elif args.max_problems is not None and not problems:
        problems += conversations_problem(args.max_problems, args.k)
    if args.seed < 0:
        problems.append(f"--seed {args.seed}: give a sampling seed >= 0")
    if args.max_concurrent_tools < 1:
        problems.append(f"--max-concurrent-tools {args.max_concurrent_tools}: give the tool calls run at once, >= 1")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        problems.append(
            f"--tokenizer {args.tokenizer} is not a directory: give a tokenizer directory (or leave it out)"
        )
    if args.output is not None:
        problems += output_problems(Path(args.output))
    if not math.isfinite(args.temperature) or args.temperature <= 0:
        problems.append(f"--temperature {args.temperature}: give a finite sampling temperature > 0 (e.g. 0.6)")
    if args.max_completion_tokens < 1:
        problems.append(f"--max-completion-tokens {args.max_completion_tokens}: give a token budget >= 1")
    if args.max_turns < 1:
        problems.append(f"--max-turns {args.max_turns}: give the assistant turns allowed per conversation, >= 1")
    if args.model is not None and not Path(args.model, "config.json").is_file():
        problems.append(_model_problem(Path(args.model)))
    if args.server is not None and args.vllm_args:
        problems.append(f"vLLM flags {args.vllm_args} configure the server --model starts; with --server, drop them")
    task = _task_row(args.task)
    if task is None:
        from trl_gptoss.data.tasks import TASKS

        problems.append(f"--task {args.task!r} is not a task; choose one of {sorted(TASKS)}")
        return problems
    problems += _dataset_problems(args, task)
    return problems


def conversations_problem(count: int, k: int) -> list[str]:
    """The refusal of ``count`` problems x ``k`` samples when they are more conversations than one run holds."""
    from trl_gptoss.evaluation.run import MAX_CONVERSATIONS, MAX_CONVERSATIONS_REASON

    if count * k <= MAX_CONVERSATIONS:
        return []
    return [
        f"{count} problems x --k {k} = {count * k} conversations, more than the {MAX_CONVERSATIONS} one run holds: "
        f"{MAX_CONVERSATIONS_REASON}; lower --max-problems or --k"
    ]


def output_problems(output: Path) -> list[str]:
    """Why ``--output`` cannot be written, found by writing a probe file beside it (and removing it) before
    anything starts: a run must not sample for minutes and then fail to keep what it sampled."""
    if output.is_dir():
        return [f"--output {output} is a directory: give a file path (e.g. {output / 'eval.json'})"]
    probe = output.parent / f".{output.name}.probe"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return [f"--output {output}: cannot write in {output.parent} ({exc.strerror or exc}); give a writable path"]
    if output.exists() and not os.access(output, os.W_OK):
        return [f"--output {output} exists and is not writable; give another path or make it writable"]
    return []


def _model_problem(model: Path) -> str:
    """Why ``--model`` (a path without ``config.json``) is not a checkpoint the server can start from."""
    adapter = model / "adapter_config.json"
    if adapter.is_file():  # a LoRA run's output_dir: the adapter alone
        try:
            base = json.loads(adapter.read_text()).get("base_model_name_or_path") or "its base model"
        except (OSError, ValueError, AttributeError):
            base = "its base model"
        return (
            f"--model {model} is a PEFT adapter (over {base}), not a checkpoint: merge it into the base first "
            "(peft: PeftModel.from_pretrained(base, dir).merge_and_unload().save_pretrained(merged)) and pass "
            "the merged directory"
        )
    what = "does not exist" if not model.exists() else "has no config.json"
    return f"--model {model} {what}: give a checkpoint directory (config.json + safetensors)"


def _split(args, task) -> str:
    """The Hub split: ``--dataset-split``, else the task's evaluation split (of its held-out set), else train."""
    return args.dataset_split or task.eval_split or "train"


def _dataset_problems(args, task) -> list[str]:
    source = _source(args, task)
    if source not in task.sources:
        return [f"--dataset-source {source}: task {task.name!r} reads its problems from {' or '.join(task.sources)}"]
    if source == "jsonl" and not args.dataset_path:
        return ["--dataset-source jsonl needs --dataset-path FILE (one JSON object per line)"]
    if source != "jsonl" and args.dataset_path:
        return [f"--dataset-path is read with --dataset-source jsonl only, not {source}; drop one of them"]
    if source == "jsonl" and not Path(args.dataset_path).is_file():
        return [f"--dataset-path {args.dataset_path} is not a file; give a JSON-lines file of the task's rows"]
    return []


def check_servers(urls: list[str], timeout: float) -> list[str]:
    """The ``--server`` URLs that do not answer ``GET /health`` with 200, each as a problem naming it."""
    from trl_gptoss.rollout.server import unhealthy

    return [
        f"--server {url} does not answer GET /health ({status}); start it (`trl-gptoss vllm-serve --model "
        "PATH`), fix the URL, or evaluate a checkpoint with --model PATH instead"
        for url, status in unhealthy(urls, timeout)
    ]


def load_problems(args) -> list[dict]:
    """The task's rows as ``evaluate_rows`` takes them (each with its ``problem`` id: its index in the set); a
    row without the columns the task's reward reads raises ``ValueError`` naming the file, line and field."""
    task = _task_row(args.task)
    if task.generate is not None:
        from trl_gptoss.scripts.grpo_eval import EVAL_SEED_OFFSET

        # The job's held-out problems of a run with seed S are drawn from S + EVAL_SEED_OFFSET: the same here.
        count = args.max_problems or GENERATED_PROBLEMS
        dataset = task.load(num_prompts=count, seed=args.seed + EVAL_SEED_OFFSET)
    elif _source(args, task) == "hub" and args.dataset_split is None and task.has_held_out_hub:
        dataset = task.load_held_out(limit=args.max_problems)  # ReTool: AIME 2024; GSM8K: its test split
    else:
        source, split = _source(args, task), _split(args, task)
        dataset = task.load(source=source, path=args.dataset_path, split=split, limit=args.max_problems)
    return [{**dict(row), "problem": index} for index, row in enumerate(dataset)]


def _refuse(problems: list[str]) -> int:
    for problem in problems:
        print(f"trl-gptoss eval: error: {problem}", file=sys.stderr)
    return 2


def _cmd_eval(args) -> int:
    from trl_gptoss.rollout.multi_server import server_urls
    from trl_gptoss.rollout.server_answers import VLLMServerError

    problems = check_arguments(args)
    urls = []
    if args.server is not None:
        try:
            urls = server_urls(args.server)
        except ValueError as exc:
            problems.append(f"--server {args.server}: {exc}")
    if problems:
        return _refuse(problems)
    problems = check_servers(urls, args.health_timeout)
    if problems:
        return _refuse(problems)
    try:
        rows = load_problems(args)
    except ValueError as exc:
        return _refuse([f"task {args.task!r}: {exc}; every row needs the columns the task's reward reads"])
    if not rows:
        return _refuse([f"task {args.task!r} has no problems in that dataset; give another --dataset-path/-source"])
    if problems := conversations_problem(len(rows), args.k):
        return _refuse(problems)
    try:
        tokenizer = _tokenizer(args)
    except (OSError, ValueError) as exc:
        return _refuse([f"--tokenizer {args.tokenizer}: cannot load a tokenizer from it ({exc})"])
    with contextlib.ExitStack() as stack:
        try:
            engine = stack.enter_context(_engine(args, urls))
        except (VLLMServerError, ValueError) as exc:  # e.g. the servers do not serve --served-model
            return _refuse([f"--served-model {args.served_model}: {exc}" if args.served_model else str(exc)])
        log = stack.enter_context(ProblemLog(args.output))
        report = evaluate(args, rows, engine, tokenizer, on_problem=log.write)
    print(format_table(report["metrics"], [args.task]))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2, default=_json_value) + "\n")
        log.discard()
        print(f"wrote {args.output}")
    return 0


class ProblemLog:
    """``<output>.partial``: one JSON line per problem, written and flushed as each finishes, so an interrupted run
    keeps what it had (the path is printed then); removed once the full report is written. No ``--output``: none."""

    def __init__(self, output: str | None):
        self.path = None if output is None else Path(f"{output}.partial")
        self._file, self.count = None, 0

    def __enter__(self):
        if self.path is not None:
            self._file = self.path.open("w")
        return self

    def write(self, result) -> None:
        if self._file is not None:
            self._file.write(json.dumps(result.to_dict(), default=_json_value) + "\n")
            self._file.flush()
        self.count += 1

    def __exit__(self, kind, error, traceback) -> None:
        if self._file is not None:
            self._file.close()
        if kind is not None and self.path is not None and self.path.exists():
            print(f"trl-gptoss eval: {self.count} finished problems kept in {self.path}", file=sys.stderr)

    def discard(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def evaluate(args, rows: list[dict], engine, tokenizer, on_problem=None) -> dict:
    """Sample, grade and summarise ``rows`` on ``engine``: ``{"settings", "metrics", "problems"}`` (what
    ``--output`` holds); ``on_problem(result)`` as each problem finishes."""
    from trl_gptoss.data.tasks import TASKS
    from trl_gptoss.evaluation import evaluate_rows, summarize, task_grader
    from trl_gptoss.evaluation.run import timed
    from trl_gptoss.rollout.config import RolloutConfig
    from trl_gptoss.tools import build_tools

    tools = build_tools(list(TASKS[args.task].tools))
    config = RolloutConfig(
        max_turns=args.max_turns,
        max_completion_tokens=args.max_completion_tokens,
        temperature=args.temperature,
        seed=args.seed,
        max_concurrent_tools=args.max_concurrent_tools,
    )
    graders = {args.task: task_grader(args.task)}
    sample = rollout_sampler(engine, tokenizer, tools, config, progress=True)
    results, seconds = timed(evaluate_rows, sample, rows, graders, args.k, args.task, on_problem)
    served = {"servers": getattr(engine, "base_urls", None), "served_model": engine.model}
    metrics = summarize(results, graders, seconds=seconds)
    metrics["samples_per_s"] = metrics["samples"] / seconds if seconds > 0 else float("nan")
    return {
        "settings": _settings(args, served, tools, config),
        "metrics": metrics,
        "problems": [result.to_dict() for result in results],
    }


def _hub_dataset(args, task) -> str:
    """The Hub dataset the problems came from: the task's held-out set unless a split of its training set was
    asked for."""
    held_out = args.dataset_split is None and task.has_held_out_hub
    return (task.eval_hub or task.hub).path if held_out else task.hub.path


def _settings(args, served: dict, tools, config) -> dict:
    import importlib.metadata

    task = _task_row(args.task)
    source = _source(args, task)
    return {
        "model": None if args.model is None else str(Path(args.model).resolve()),
        **served,
        "task": args.task,
        "dataset_source": source,
        "dataset_path": None if args.dataset_path is None else str(Path(args.dataset_path).resolve()),
        "dataset_split": _split(args, task) if source == "hub" else None,
        "hub_dataset": _hub_dataset(args, task) if source == "hub" else None,
        "max_problems": args.max_problems,
        "k": args.k,
        "temperature": config.temperature,
        "seed": config.seed,
        "max_completion_tokens": config.max_completion_tokens,
        "max_turns": config.max_turns,
        "tools": [tool.name for tool in tools],
        "trl_gptoss_version": importlib.metadata.version("trl-gptoss"),
        "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _json_value(value):
    """What ``json`` cannot write itself (harmony messages in prompts, tuples of answers are lists already)."""
    return value.to_dict() if hasattr(value, "to_dict") else str(value)


def _tokenizer(args):
    """The checkpoint's tokenizer (``--tokenizer``, else the ``--model`` directory's); without one, GPT-OSS's
    o200k Harmony tokenizer, offline."""
    from trl_gptoss.harmony.tokenizer import harmony_tokenizer

    path = args.tokenizer or args.model
    if path is not None:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            if args.tokenizer is not None:
                raise
    return harmony_tokenizer()


@contextlib.contextmanager
def _engine(args, urls: list[str]):
    """A ``MultiServerEngine`` over ``urls``, or over a server started here from ``--model`` (stopped on exit)."""
    from trl_gptoss.rollout.multi_server import MultiServerEngine

    with contextlib.ExitStack() as stack:
        secret = None  # given servers: the secret of the environment, if any (generation needs none)
        if args.model is not None:
            from trl_gptoss.rollout.server import VLLMServer
            from trl_gptoss.rollout.server_secret import new_secret

            extra = list(args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args)
            server = VLLMServer(
                args.model,
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs,
                device=args.device,
                gpu_memory_utilization=args.gpu_memory_utilization,
                extra_args=extra,
                secret=new_secret(),  # only this run may change what the server it started serves
            )
            urls, secret = [stack.enter_context(server).base_url], server.secret
        engine = MultiServerEngine(urls, args.served_model, timeout=args.timeout, secret=secret)
        stack.callback(engine.close)
        yield engine


def rollout_sampler(engine, tokenizer, tools, config, *, progress: bool = False):
    """``sample(prompts, on_rollout=None) -> rollouts`` for ``evaluate_rows``: every prompt rolled out at once
    through ``run_rollouts``'s loop on ``engine``, ``on_rollout(index, rollout)`` as each conversation ends; with
    ``progress``, a bar counting finished conversations (shown once a run has taken ``PROGRESS_DELAY_S``)."""
    from trl_gptoss.rollout.event_loop import run_to_completion
    from trl_gptoss.rollout.loop import arun_rollouts

    def sample(prompts, on_rollout=None):
        with _progress_bar(len(prompts), enabled=progress) as bar:

            def ended(index: int, rollout) -> None:
                bar.update(1)
                if on_rollout is not None:
                    on_rollout(index, rollout)

            async def rollouts():
                with on_conversation_end(ended, with_rollout=True):
                    return await arun_rollouts(engine, prompts, tokenizer=tokenizer, tools=tools, config=config)

            return run_to_completion(rollouts())

    return sample


def _progress_bar(total: int, *, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="eval", unit="conversation", delay=PROGRESS_DELAY_S, disable=not enabled)


@contextlib.contextmanager
def on_conversation_end(callback, *, with_rollout: bool = False):
    """Within it, ``callback(index)`` (``with_rollout``: ``callback(index, rollout)``) runs on the running event
    loop whenever a conversation of ``arun_rollouts`` started there ends with its rollout (its task, named
    ``rollout-<index>``, finished; a cancelled or failed one is not counted). It installs a task factory on the
    loop for the duration (the previous one is restored)."""
    loop = asyncio.get_running_loop()
    previous = loop.get_task_factory()

    def ended(task: asyncio.Task) -> None:
        name = task.get_name()
        if name.startswith(CONVERSATION_TASK_PREFIX) and not task.cancelled() and task.exception() is None:
            index = int(name[len(CONVERSATION_TASK_PREFIX) :])
            if with_rollout:
                callback(index, task.result())
            else:
                callback(index)

    def factory(loop, coro, **kwargs):
        task = previous(loop, coro, **kwargs) if previous is not None else asyncio.Task(coro, loop=loop, **kwargs)
        task.add_done_callback(ended)
        return task

    loop.set_task_factory(factory)
    try:
        yield
    finally:
        loop.set_task_factory(previous)


# -- the table ----------------------------------------------------------------------------------------------------
ROW_LABELS = {
    "reward": "reward",
    "tool_calls": "tool calls / episode",
    "turns": "turns / episode",
    "truncated": "truncated",
    "reward_errors": "reward errors",
    "problems": "problems",
    "samples": "samples",
    "seconds": "seconds",
    "samples_per_s": "samples / s",
}


def format_table(metrics: dict, tasks: list[str]) -> str:
    """The metrics of ``summarize`` as a table: one column per task and one overall; accuracies as
    ``mean ± standard error``."""
    columns = [(task, f"{task}/") for task in tasks] + [("overall", "")]
    accuracy = list(dict.fromkeys(key.split("/")[-1] for key in metrics if f"{key}_stderr" in metrics))
    width = max(len(label) for label in [*accuracy, *ROW_LABELS.values()]) + 2
    lines = [f"{'':<{width}}" + "".join(f"{title:>18}" for title, _ in columns)]
    for name in accuracy:
        cells = [_accuracy(metrics, prefix + name) for _, prefix in columns]
        lines.append(f"{name:<{width}}" + "".join(f"{cell:>18}" for cell in cells))
    for name, label in ROW_LABELS.items():
        cells = [_number(name, metrics.get(prefix + name)) for _, prefix in columns]
        if any(cells):
            lines.append(f"{label:<{width}}" + "".join(f"{cell:>18}" for cell in cells))
    return "\n".join(lines)


def _accuracy(metrics: dict, key: str) -> str:
    if key not in metrics:
        return ""
    return f"{metrics[key]:.3f} ± {metrics[key + '_stderr']:.3f}"


def _number(name: str, value) -> str:
    if value is None:
        return ""
    if name == "truncated":
        return f"{value:.1%}"
    if name in ("reward_errors", "problems", "samples"):
        return f"{value:.0f}"
    return f"{value:.2f}" if name in ("seconds", "samples_per_s", "tool_calls", "turns") else f"{value:.3f}"


# -- the parser ---------------------------------------------------------------------------------------------------
def _finite_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _positive_seconds(text: str) -> float:
    value = _finite_float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def register(sub) -> None:
    """Add ``eval`` to the console script's subparsers."""
    from trl_gptoss.rollout.config import RolloutConfig

    defaults = RolloutConfig()
    cmd = sub.add_parser(
        "eval",
        help="held-out accuracy (mean@k, pass@k, maj@k) of a checkpoint or of running vLLM servers",
        description=(
            "Samples every problem k times with the task's tools (all in flight together), grades them with the "
            "task's reward and prints the trainer's metrics per task and overall; --output keeps them per problem. "
            "Exit 0: evaluated, 2: refused (the message says what to change)."
        ),
    )
    where = cmd.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="checkpoint directory: a vLLM server is started for it and stopped after")
    where.add_argument("--server", help="running vLLM server(s): base URL, or several separated by commas")
    cmd.add_argument("--task", required=True, help="a task of trl_gptoss.data.TASKS: its rows, reward and tools")
    cmd.add_argument(
        "--dataset-source",
        choices=("sample", "hub", "jsonl", "generated"),
        default=None,
        help="where the problems come from (default: the task's shipped samples, or drawn for a generated task)",
    )
    cmd.add_argument("--dataset-path", help="the JSON-lines file of --dataset-source jsonl (the samples' format)")
    cmd.add_argument(
        "--dataset-split",
        help="Hub split of the training set (default: the task's held-out Hub set -- ReTool: AIME 2024, GSM8K: "
        "its test split -- else train)",
    )
    cmd.add_argument("--k", type=int, default=8, help="samples per problem (default 8)")
    cmd.add_argument("--temperature", type=_finite_float, default=0.6, help="sampling temperature (default 0.6)")
    cmd.add_argument(
        "--max-problems",
        type=int,
        default=None,
        help=f"evaluate the first N problems (default: all; a generated task draws {GENERATED_PROBLEMS})",
    )
    cmd.add_argument(
        "--max-completion-tokens",
        type=int,
        default=defaults.max_completion_tokens,
        help="token budget per conversation, sampled and tool tokens together",
    )
    cmd.add_argument("--max-turns", type=int, default=defaults.max_turns, help="assistant turns per conversation")
    cmd.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed (conversation i, turn t: derive_seed(seed, i, t)); a generated task's problems are "
        "the held-out ones of a training run with this seed",
    )
    cmd.add_argument("--output", help="write settings, metrics and per-problem results here (JSON)")
    cmd.add_argument("--tokenizer", help="tokenizer directory (default: --model's, else GPT-OSS's o200k Harmony)")
    cmd.add_argument("--max-concurrent-tools", type=int, default=defaults.max_concurrent_tools)
    cmd.add_argument("--served-model", default=None, help="model id on the servers (default: the only one)")
    cmd.add_argument("--timeout", type=_positive_seconds, default=600.0, help="deadline of one HTTP call (s)")
    cmd.add_argument("--health-timeout", type=_positive_seconds, default=10.0, help="GET /health deadline (s)")
    server = cmd.add_argument_group("the server --model starts")
    server.add_argument("--max-model-len", type=int, default=8192, help="context length (prompt + completion)")
    server.add_argument("--max-num-seqs", type=int, default=64, help="sequences the server batches at once")
    server.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    server.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    server.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        help="after `--`: extra flags for the vLLM server --model starts (as `trl-gptoss vllm-serve` takes them)",
    )
    cmd.set_defaults(func=_cmd_eval)
