"""The weight push's process group on one GPU: what one device can check of the NCCL/gloo transport.

One GPU cannot hold the trainer and a server as two NCCL ranks (NCCL refuses two ranks on one device), so the
full NCCL push needs two GPUs and a vLLM server environment, which the lent host lacks. What this part checks:

- ``nccl_group``: our ``WeightGroup`` over NCCL as a world of one (the trainer's end alone): the process group
  built outside any default group, the warm-up all-reduce, a broadcast from a CUDA bucket. Skipped on the CPU.
- ``gloo_from_device``: a layer of GPT-OSS-20B-shaped tensors (bf16) on the device, cut into buckets and packed as
  the pusher does (``bucket_pieces``), broadcast over gloo to a receiver in another process, which rebuilds the
  tensors (``unpack``); their SHA-256 must equal the sender's. This is the one-GPU host's real push path
  (``backend_for`` picks gloo when a worker shares the trainer's GPU; the pusher stages on the host). Measured:
  GB/s of the staging and the broadcasts.
- ``backend_for``: NCCL for a worker on another GPU, gloo for one on this GPU (or on the CPU).

    python benchmarks/bench_gpu_transfer.py [--out ...] [--budget-s 40]
    python benchmarks/bench_gpu_transfer.py --dry-run --out /tmp/transfer.json   # CPU, tiny layer: the logic only
"""

from __future__ import annotations

import hashlib
import multiprocessing
import time

import torch
from gpu_common import FAILED, Bench, parser

from trl_gptoss.rollout.vllm_worker.gptoss_vllm_transfer import WeightGroup, bind_listener, bucket_pieces, layer_header

# a gpt-oss-20b decoder layer's tensors in bf16 (experts gate_up [32, 2880, 5760], down [32, 2880, 2880]) with a
# quarter of the experts, so the part stays within its budget; the dry run a tiny one
GPU_LAYER = {"gate_up_proj": (8, 2880, 5760), "down_proj": (8, 2880, 2880), "q_proj": (4096, 2880), "sinks": (64,)}
DRY_LAYER = {"gate_up_proj": (2, 16, 32), "down_proj": (2, 16, 16), "q_proj": (64, 16), "sinks": (8,)}
BUCKET = {"cuda": 256 << 20, "cpu": 4 << 10}
TIMEOUT_S = 60.0


def _digest(named) -> dict[str, str]:
    return {
        n: hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in named
    }


def _loopback_gloo(port: int, rank: int, listener=None) -> WeightGroup:
    """Rank ``rank`` of a two-rank gloo weight group on loopback (rank 0 serves the rendezvous on ``listener``)."""
    return WeightGroup(
        backend="gloo",
        host="127.0.0.1",
        port=port,
        token="bench",
        rank=rank,
        world_size=2,
        timeout_s=TIMEOUT_S,
        device=torch.device("cpu"),
        listen=listener,
    )


def _receive(port: int, header: dict, queue) -> None:
    try:
        group = _loopback_gloo(port, 1)
        queue.put(_digest(group.receive(header)))
        group.close()
    except Exception as error:  # reported by the sender
        queue.put(f"{type(error).__name__}: {error}")


def gloo_from_device(bench: Bench) -> dict:
    shapes = DRY_LAYER if bench.dry_run else GPU_LAYER
    generator = torch.Generator(bench.device).manual_seed(0)
    named = [
        (n, torch.randn(s, device=bench.device, generator=generator).to(torch.bfloat16)) for n, s in shapes.items()
    ]
    header = layer_header(named, BUCKET[bench.device])
    listener = bind_listener("127.0.0.1")
    port = listener.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    receiver = context.Process(target=_receive, args=(port, header, queue), daemon=True)
    receiver.start()
    group = _loopback_gloo(port, 0, listener)
    buffer = torch.empty(header["bucket_bytes"], dtype=torch.uint8)
    started = time.perf_counter()
    staged = [t.to("cpu") for _, t in named]  # the gloo push stages device tensors on the host, as the pusher does
    for piece, _last in bucket_pieces(staged, header, lambda: buffer):
        group.wait(group.broadcast(piece))
    seconds = time.perf_counter() - started
    received = queue.get(timeout=TIMEOUT_S)
    receiver.join(TIMEOUT_S)
    group.close()
    if isinstance(received, str):
        raise RuntimeError(f"the receiver failed: {received}")
    sent = _digest(named)
    bench.check("gloo_from_device bytes", float(sum(sent[n] != received.get(n) for n in sent)), 0.0)
    gigabytes = header["total"] / 1e9
    return {
        "case": "gloo_from_device",
        "layer_gb": gigabytes,
        "buckets": -(-header["total"] // header["bucket_bytes"]),
        "seconds": seconds,
        "gb_per_s": gigabytes / seconds,
    }


def nccl_group(bench: Bench) -> dict:
    listener = bind_listener("127.0.0.1")
    started = time.perf_counter()
    group = WeightGroup(
        backend="nccl",
        host="127.0.0.1",
        port=listener.getsockname()[1],
        token="bench",
        rank=0,
        world_size=1,
        timeout_s=TIMEOUT_S,
        device=torch.device("cuda", torch.cuda.current_device()),
        listen=listener,
    )
    formed = time.perf_counter() - started
    bucket = torch.arange(1 << 20, device="cuda", dtype=torch.int32).view(torch.uint8)
    expected = bucket.clone()
    group.wait(group.broadcast(bucket))
    torch.cuda.synchronize()
    bench.check("nccl_group broadcast keeps the root's bytes", float((bucket != expected).sum()), 0.0)
    group.close()
    return {"case": "nccl_group", "seconds": formed, "layer_gb": None, "gb_per_s": None}


def backend_rule(bench: Bench) -> dict:
    from trl_gptoss.rollout.weights.group_push import backend_for

    if bench.device != "cuda":
        chosen = {"cpu workers": backend_for([{"device": "cpu"}])}
        bench.check("backend_for cpu -> gloo", float(chosen["cpu workers"] != "gloo"), 0.0)
        return {"case": "backend_for", **chosen}
    mine = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    chosen = {
        "worker on this GPU": backend_for([{"device": "cuda", "gpu": mine}]),
        "worker on another GPU": backend_for([{"device": "cuda", "gpu": "GPU-another"}]),
    }
    expected = {"worker on this GPU": "gloo", "worker on another GPU": "nccl"}
    bench.check("backend_for", float(chosen != expected), 0.0, chosen=chosen)
    return {"case": "backend_for", **chosen}


def body(bench: Bench) -> None:
    cases = [("backend_for", backend_rule), ("gloo_from_device", gloo_from_device)]
    if bench.device == "cuda":
        cases.insert(1, ("nccl_group", nccl_group))
    else:
        bench.skip({"case": "nccl_group"}, "NCCL needs a CUDA device")
    for name, run in cases:
        reason = bench.fits_time(20)
        if reason:
            bench.skip({"case": name}, reason)
            continue
        row = bench.attempt({"case": name}, run, bench)
        if row is not FAILED:
            bench.rows.append(row)
            print(row, flush=True)
    rate = next((r["gb_per_s"] for r in bench.rows if r["case"] == "gloo_from_device"), None)
    bench.goal("gloo push from the device, GB/s", rate, "reported (no target: loopback TCP)", None)


def main(argv=None) -> int:
    args = parser(__doc__.splitlines()[0], default_budget_s=40).parse_args(argv)
    bench = Bench("transfer", args)
    bench.columns = (
        ("case", "case", ""),
        ("layer_gb", "layer GB", ".3f"),
        ("seconds", "s", ".3f"),
        ("gb_per_s", "GB/s", ".2f"),
    )
    return bench.run(body)


if __name__ == "__main__":
    raise SystemExit(main())
