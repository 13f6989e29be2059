"""Memory of the vLLM rollout server per process (API server, engine core, worker), idle and under load.

Starts ``trl_gptoss.rollout.VLLMServer`` on the demo model (built here, randomly initialised: memory does not
depend on the weights' values) once per variant, checks that 16 concurrent rollout requests (the trainer's own
``completion_payload``, token ids in and out, 96 tokens each) come back parseable, times three such batches, and
samples ``/proc/PID/smaps_rollup`` of every process in the server's group every 0.2 s. ``pss`` splits pages
shared between processes, so the summed PSS is what the server adds to the machine.

    .venv/bin/python benchmarks/bench_server_memory.py --json benchmarks/results/server_memory_cpu.json

Variants: ``before`` = the old launcher's settings (``VLLM_CPU_KVCACHE_SPACE=1``, tokenizer loaded),
``sized_kv`` = KV cache from the model, tokenizer loaded, ``default`` = today's defaults (sized KV cache, no
tokenizer). The 1-minute load average is recorded beside every number (a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import requests

from trl_gptoss.rollout.server import VLLMServer, live_group_members
from trl_gptoss.rollout.types import GenerationRequest
from trl_gptoss.rollout.vllm_engine import completion_payload, generation_from_choice

VARIANTS = {
    "before": ({"load_tokenizer": True}, {"VLLM_CPU_KVCACHE_SPACE": "1"}),
    "sized_kv": ({"load_tokenizer": True}, {}),
    "default": ({}, {}),
}
FIELDS = ("Rss", "Pss", "Anonymous")


def _process(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in FIELDS:
                    out[key.lower() + "_mib"] = int(value.split()[0]) // 1024
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            out["name"] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:60]
    except OSError:
        pass
    return out


def _snapshot(pgid: int) -> dict:
    return {pid: p for pid in live_group_members(pgid) if (p := _process(pid))}


def _total(snapshot: dict, key: str) -> int:
    return sum(p.get(key, 0) for p in snapshot.values())


def _batch(server: VLLMServer, n: int, tokens: int) -> float:
    def one(i: int) -> int:
        request = GenerationRequest([200006, 1000 + i, 2000, 3000], tokens, temperature=0.7, seed=i)
        answer = requests.post(
            f"{server.base_url}/v1/completions", json=completion_payload(server.model_dir, request), timeout=600
        )
        answer.raise_for_status()
        return len(generation_from_choice(answer.json()["choices"][0]).token_ids)

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        lengths = list(pool.map(one, range(n)))
    assert lengths == [tokens] * n, lengths
    return round(time.monotonic() - started, 2)


def measure(checkpoint: Path, variant: str, max_model_len: int) -> dict:
    kwargs, env = VARIANTS[variant]
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", *env)}
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.update(env)
    try:
        server = VLLMServer(checkpoint, device="cpu", max_model_len=max_model_len, max_num_seqs=16, **kwargs)
        peak: dict = {"pss_mib": 0}
        done = threading.Event()
        with server:
            pgid = server.process.pid

            def sample() -> None:
                while not done.is_set():
                    snap = _snapshot(pgid)
                    if _total(snap, "pss_mib") > peak["pss_mib"]:
                        peak.update(pss_mib=_total(snap, "pss_mib"), rss_mib=_total(snap, "rss_mib"), per=snap)
                    done.wait(0.2)

            idle = _snapshot(pgid)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            batches = [_batch(server, 16, 96) for _ in range(3)]
            done.set()
            sampler.join()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {
        "variant": variant,
        "flags": [a for a in server.command if a in ("--skip-tokenizer-init", "--kv-cache-memory-bytes")],
        "kv_cache_bytes": server.kv_cache_bytes,
        "startup_s": round(server.startup_seconds, 1),
        "batch_16x96_s": batches,
        "load_1min": round(os.getloadavg()[0], 1),
        "idle": {"pss_mib": _total(idle, "pss_mib"), "rss_mib": _total(idle, "rss_mib"), "per_process": idle},
        "peak": {"pss_mib": peak["pss_mib"], "rss_mib": peak["rss_mib"], "per_process": peak["per"]},
    }


def _demo_checkpoint(path: Path) -> Path:
    from trl_gptoss.demo.model import build_tiny_gpt_oss, save_checkpoint
    from trl_gptoss.harmony import harmony_tokenizer

    tokenizer = harmony_tokenizer()
    return save_checkpoint(build_tiny_gpt_oss(tokenizer, attn_implementation="eager"), tokenizer, path)


def main() -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--max_model_len", type=int, default=4096, help="the trainer's rollout_max_model_len")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-server-memory-") as tmp:
        checkpoint = _demo_checkpoint(Path(tmp) / "demo")
        results = [measure(checkpoint, v, args.max_model_len) for v in args.variants]
    print(f"{'variant':10s} {'idle PSS':>9s} {'peak PSS':>9s} {'peak RSS':>9s} {'start s':>8s}  batches s   load")
    for r in results:
        print(
            f"{r['variant']:10s} {r['idle']['pss_mib']:9d} {r['peak']['pss_mib']:9d} {r['peak']['rss_mib']:9d} "
            f"{r['startup_s']:8.1f}  {r['batch_16x96_s']}  {r['load_1min']}"
        )
        for pid, p in sorted(r["peak"]["per_process"].items()):
            print(f"    {pid:>7d} PSS {p.get('pss_mib', 0):5d} MiB  {p.get('name', '')}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
