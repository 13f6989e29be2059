"""A timeline of one rollout run for ``bench_rollouts.py --timeline``: engine requests, HTTP calls, tool runs.

Events (seconds since the run started):

- ``gen``: one ``engine.generate`` call as the loop sees it: ``submit`` (the loop called it), ``sent`` (the
  HTTP engine was called; later than ``submit`` only when a wrapper awaits first), ``http_start`` /
  ``http_end`` (the HTTP call started / its answer was read), ``done`` (the loop resumed with it),
  ``conversation`` and ``turn`` (from the request's seed), ``tokens`` sampled, ``prompt`` length;
- ``tool``: one sandbox run: ``start`` / ``end`` on its worker thread;
- ``engine``: vLLM's own counters over the run (``/metrics``): engine steps, prompt tokens computed and
  served from the prefix cache, generation tokens.

``summary`` turns them into the numbers that say where a variant loses time: time between the engine call
and its HTTP call (``http_start - submit``: wrappers and waiting for a free connection), loop resume lag
(``done - http_end``), sequences per engine step, how much tool time overlapped generation, and the critical
conversation's split into generate / tool / waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
import time

import requests

from trl_gptoss.tools import PythonTool

_METRICS = {
    "steps": r"^vllm:iteration_tokens_total_count\{[^}]*\} ([0-9.e+]+)",
    "step_tokens": r"^vllm:iteration_tokens_total_sum\{[^}]*\} ([0-9.e+]+)",
    "prompt_tokens": r"^vllm:prompt_tokens_total\{[^}]*\} ([0-9.e+]+)",
    "cached_prompt_tokens": r"^vllm:prompt_tokens_cached_total\{[^}]*\} ([0-9.e+]+)",
    "generation_tokens": r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)",
}


def engine_counters(base_url: str, server_pid: int | None = None) -> dict[str, float]:
    """vLLM's cumulative counters (missing ones read 0) and CPU seconds used so far: ``cpu_server`` (the server's
    process tree, when ``server_pid`` is given), ``cpu_client`` (this process), ``cpu_tools`` (this process's
    reaped children: the sandbox runs)."""
    text = requests.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for key, pattern in _METRICS.items():
        out[key] = sum(float(v) for v in re.findall(pattern, text, flags=re.M))
    times = os.times()
    out["cpu_client"] = times.user + times.system
    out["cpu_tools"] = times.children_user + times.children_system
    if server_pid is not None:
        import psutil

        server = psutil.Process(server_pid)
        out["cpu_server"] = 0.0
        for process in [server, *server.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                cpu = process.cpu_times()
                out["cpu_server"] += cpu.user + cpu.system
    return out


class Timeline:
    """Collects events from the hooks below; ``start()`` resets it for the next run."""

    def __init__(self, seeds: dict[int, tuple[int, int]]):
        self.seeds = seeds  # seed -> (conversation, turn)
        self.lock = threading.Lock()
        self.start()

    def start(self):
        self.t0 = time.perf_counter()
        self.gens: dict[int, dict] = {}
        self.tools: list[dict] = []
        self.stalls: list[tuple[float, float]] = []  # (when, seconds late) of the loop watcher
        self._watched = None

    def watch_loop(self) -> None:
        """Start (once per event loop) a task that wakes every 5 ms and records how late it woke: the time the
        loop was blocked (the GIL held by another thread, or slow work on the loop itself)."""
        loop = asyncio.get_running_loop()
        if getattr(self, "_watched", None) is loop:
            return
        self._watched = loop

        async def watch():
            while True:
                before = time.perf_counter()
                await asyncio.sleep(0.005)
                late = time.perf_counter() - before - 0.005
                if late > 0.002:
                    self.stalls.append((before - self.t0, late))

        loop.create_task(watch())

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def gen(self, seed) -> dict:
        with self.lock:
            conversation, turn = self.seeds.get(seed, (-1, -1))
            return self.gens.setdefault(seed, {"conversation": conversation, "turn": turn})


def instrument_http(engine, timeline: Timeline) -> None:
    """Record when each generation's HTTP call starts (a connection is free and the request is written) and
    when its answer is decoded: wraps the engine instance's ``arequest`` (the benchmark owns the engine)."""
    inner = engine.arequest

    async def arequest(method, path, payload=None, **kwargs):
        event = timeline.gen(payload.get("seed")) if isinstance(payload, dict) else {}
        event["http_start"] = timeline.now()
        try:
            return await inner(method, path, payload, **kwargs)
        finally:
            event["http_end"] = timeline.now()

    engine.arequest = arequest
    outer = engine.generate

    async def generate(request):
        timeline.gen(request.seed)["sent"] = timeline.now()
        return await outer(request)

    engine.generate = generate


class TimedPythonTool(PythonTool):
    """``PythonTool`` that records each sandbox run's start and end."""

    timeline: Timeline | None = None

    def run_code(self, code):
        start = self.timeline.now() if self.timeline else 0.0
        try:
            return super().run_code(code)
        finally:
            if self.timeline:
                with self.timeline.lock:
                    self.timeline.tools.append({"start": start, "end": self.timeline.now()})


def _union(intervals) -> list[tuple[float, float]]:
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(intervals, cover) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in intervals for c, d in cover)


def summary(timeline: Timeline, wall: float, counters: dict[str, float]) -> dict:
    """Where the time went in one run (see the module docstring)."""
    gens = [g for g in timeline.gens.values() if "done" in g]
    queue = [g["http_start"] - g["submit"] for g in gens if "http_start" in g]
    resume = [g["done"] - g["http_end"] for g in gens if "http_end" in g]
    busy = _union((g["submit"], g["done"]) for g in gens)
    tool_time = sum(t["end"] - t["start"] for t in timeline.tools)
    by_conversation: dict[int, list] = {}
    for g in gens:
        by_conversation.setdefault(g["conversation"], []).append(g)
    last = max(by_conversation.values(), key=lambda gs: max(g["done"] for g in gs))
    last_gen = sum(g["done"] - g["submit"] for g in last)
    steps = counters.get("steps", 0.0)
    return {
        "requests": len(gens),
        "engine_steps": steps,
        "tokens_per_step": counters.get("step_tokens", 0.0) / steps if steps else None,
        "generation_tokens_per_step": counters.get("generation_tokens", 0.0) / steps if steps else None,
        "prompt_tokens": counters.get("prompt_tokens"),
        "cached_prompt_tokens": counters.get("cached_prompt_tokens"),
        "http_queue_ms_mean": 1e3 * sum(queue) / max(len(queue), 1),
        "http_queue_ms_max": 1e3 * max(queue, default=0.0),
        "loop_resume_ms_mean": 1e3 * sum(resume) / max(len(resume), 1),
        "loop_resume_ms_max": 1e3 * max(resume, default=0.0),
        "cpu_s": {k.removeprefix("cpu_"): v for k, v in counters.items() if k.startswith("cpu_")},
        "loop_stalls_over_2ms": len(timeline.stalls),
        "loop_stalled_s": sum(late for _, late in timeline.stalls),
        "loop_stall_max_ms": 1e3 * max((late for _, late in timeline.stalls), default=0.0),
        "tool_runs": len(timeline.tools),
        "tool_s_mean": tool_time / max(len(timeline.tools), 1),
        "tool_share_overlapping_generation": _overlap([(t["start"], t["end"]) for t in timeline.tools], busy)
        / max(tool_time, 1e-9),
        "last_conversation": {
            "conversation": last[0]["conversation"],
            "turns": len(last),
            "generate_s": last_gen,
            "other_s": max(g["done"] for g in last) - last_gen,
        },
        "wall_s": wall,
        "events": {"gen": sorted(gens, key=lambda g: g["submit"]), "tool": timeline.tools},
    }


def text_timeline(timeline: Timeline, width: int = 100) -> str:
    """One line per conversation: ``=`` awaiting the engine, ``.`` elsewhere (tools, queueing), `` `` done."""
    gens = [g for g in timeline.gens.values() if "done" in g]
    end = max([g["done"] for g in gens] + [t["end"] for t in timeline.tools], default=1.0)
    lines = []
    for c in sorted({g["conversation"] for g in gens}):
        row = [" "] * width
        mine = sorted((g for g in gens if g["conversation"] == c), key=lambda g: g["submit"])
        for i in range(int(mine[-1]["done"] / end * (width - 1)) + 1):
            row[i] = "."
        for g in mine:
            for i in range(int(g["submit"] / end * (width - 1)), int(g["done"] / end * (width - 1)) + 1):
                row[i] = "="
        lines.append(f"conv {c:>2} |{''.join(row)}|")
    row = [" "] * width
    for t in timeline.tools:
        for i in range(int(t["start"] / end * (width - 1)), int(t["end"] / end * (width - 1)) + 1):
            row[i] = "#" if row[i] == " " else "%"
    lines.append(f"tools   |{''.join(row)}|  (# one sandbox run, % several)")
    lines.append(f"         0 s{'':>{width - 12}}{end:.2f} s")
    return "\n".join(lines)


def send_waves(gens: list[dict], gap: float = 0.01) -> list[dict]:
    """Requests grouped by when their HTTP call started: a new wave when ``gap`` seconds passed without one.
    Per wave: its start, how many requests of each turn it held, their mean prompt length and sampled tokens,
    and when its last answer came back."""
    waves: list[dict] = []
    for g in sorted((g for g in gens if "http_start" in g), key=lambda g: g["http_start"]):
        if not waves or g["http_start"] - waves[-1]["last_sent"] > gap:
            waves.append({"at": g["http_start"], "last_sent": g["http_start"], "turns": {}, "prompt": [], "tokens": []})
        wave = waves[-1]
        wave["last_sent"] = g["http_start"]
        wave["turns"][g["turn"]] = wave["turns"].get(g["turn"], 0) + 1
        wave["prompt"].append(g.get("prompt", 0))
        wave["tokens"].append(g.get("tokens", 0))
        wave["last_done"] = max(wave.get("last_done", 0.0), g.get("done", 0.0))
    return waves


def text_waves(gens: list[dict], gap: float = 0.01) -> str:
    """``send_waves`` as a table, one line per wave."""
    lines = [f"{'sent at s':>10}{'spread ms':>10}{'requests by turn':>22}{'prompt':>8}{'sampled':>9}{'all back s':>11}"]
    for w in send_waves(gens, gap):
        turns = " ".join(f"t{t}:{n}" for t, n in sorted(w["turns"].items()))
        lines.append(
            f"{w['at']:>10.3f}{1e3 * (w['last_sent'] - w['at']):>10.1f}{turns:>22}"
            f"{sum(w['prompt']) / len(w['prompt']):>8.0f}{sum(w['tokens']) / len(w['tokens']):>9.1f}"
            f"{w['last_done']:>11.3f}"
        )
    return "\n".join(lines)
