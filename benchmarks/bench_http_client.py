"""Client-side cost of one engine request: the event loop's own HTTP client vs a blocking call on a thread.

A stand-in server in another process answers every ``POST /v1/completions`` at once with a fixed ~5 kB JSON
body shaped like a vLLM completion (200 token ids and log-probs), so the time measured is the client's: encode,
send, wait for the loop or a worker thread, read, decode. ``--streams`` concurrent "conversations" each send
``--requests`` requests one after another (a rollout's turns). Variants, interleaved run by run:

- ``event-loop``: ``trl_gptoss.rollout.http_async.AsyncHTTPClient`` (what ``VLLMServerEngine.generate`` uses);
- ``thread-pool``: ``run_in_executor`` of a blocking ``requests`` call, one ``Session`` per worker thread (64
  workers), the engine's path before.

``--busy-threads N`` adds N threads running pure-Python loops (they hold the GIL, as CPU-bound work on tool
threads would). Reported: wall seconds per run and per-request latency (median/mean over all requests), median
of ``--repeats``, with the 1-minute load average (the machine may be shared).

    .venv/bin/python benchmarks/bench_http_client.py [--repeats 3] [--busy-threads 0] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trl_gptoss.rollout.http_async import AsyncHTTPClient  # noqa: E402

N_TOKENS = 200
BODY = json.dumps(
    {
        "choices": [
            {
                "finish_reason": "length",
                "token_ids": list(range(N_TOKENS)),
                "logprobs": {"tokens": [f"token_id:{i}" for i in range(N_TOKENS)], "token_logprobs": [-0.1] * N_TOKENS},
            }
        ]
    }
).encode()
PAYLOAD = {"prompt": list(range(300)), "max_tokens": N_TOKENS, "logprobs": 0}


def serve(port_queue) -> None:
    """The stand-in server: HTTP/1.1 keep-alive, answers each request with ``BODY``."""

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
                )
                writer.write(BODY)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port_queue.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def spin(stop: threading.Event) -> None:
    while not stop.is_set():
        total = 0
        for i in range(20000):
            total += i


def one_run(variant: str, url: str, streams: int, count: int, busy_threads: int) -> dict:
    stop = threading.Event()
    spinners = [threading.Thread(target=spin, args=(stop,)) for _ in range(busy_threads)]
    for thread in spinners:
        thread.start()
    latencies: list[float] = []
    pool = ThreadPoolExecutor(64)
    local = threading.local()
    client = AsyncHTTPClient(url, connect_timeout=5.0, max_connections=64)

    def blocking():
        if not hasattr(local, "session"):
            local.session = requests.Session()
        return local.session.post(f"{url}/v1/completions", json=PAYLOAD, timeout=(5.0, 30.0)).json()

    async def send():
        if variant == "event-loop":
            return (await client.request("POST", "/v1/completions", PAYLOAD, timeout=30.0)).json()
        return await asyncio.get_running_loop().run_in_executor(pool, blocking)

    async def conversation():
        for _ in range(count):
            start = time.perf_counter()
            answer = await send()
            latencies.append(time.perf_counter() - start)
            assert len(answer["choices"][0]["token_ids"]) == N_TOKENS

    async def main():
        await asyncio.gather(*(conversation() for _ in range(streams)))

    load = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        asyncio.run(main())
    finally:
        wall = time.perf_counter() - start
        stop.set()
        for thread in spinners:
            thread.join()
        pool.shutdown()
    return {
        "wall_s": wall,
        "latency_ms_median": 1e3 * statistics.median(latencies),
        "latency_ms_mean": 1e3 * statistics.mean(latencies),
        "load_1m_at_start": load,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--busy-threads", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/http_client_cpu.json"))
    args = parser.parse_args(argv)
    ports = multiprocessing.Queue()
    server = multiprocessing.Process(target=serve, args=(ports,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{ports.get(timeout=30)}"
    variants = ("event-loop", "thread-pool")
    runs = {v: [] for v in variants}
    try:
        for variant in variants:  # warm-up
            one_run(variant, url, args.streams, 2, 0)
        for _ in range(args.repeats):
            for variant in variants:
                runs[variant].append(one_run(variant, url, args.streams, args.requests, args.busy_threads))
    finally:
        server.terminate()
    median = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    loads = [r["load_1m_at_start"] for rs in runs.values() for r in rs]
    print(
        f"{args.streams} streams x {args.requests} requests, {args.busy_threads} GIL-holding threads; "
        f"1-minute load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores"
    )
    print(f"{'variant':<14}{'wall s':>9}{'latency median ms':>20}{'latency mean ms':>18}")
    for variant, m in median.items():
        print(f"{variant:<14}{m['wall_s']:>9.2f}{m['latency_ms_median']:>20.1f}{m['latency_ms_mean']:>18.1f}")
    result = {
        "streams": args.streams,
        "requests_per_stream": args.requests,
        "busy_threads": args.busy_threads,
        "answer_bytes": len(BODY),
        "cpu_count": os.cpu_count(),
        "load_average_1m_range": [min(loads), max(loads)],
        "median": median,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
