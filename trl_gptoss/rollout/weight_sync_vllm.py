"""Push a trainer model's weights into a running vLLM server, every parameter, one decoder layer at a time.

The server side is the worker extension ``vllm_worker/gptoss_vllm_worker.py`` (started by ``VLLMServer``):
- CPU (``HTTPWeightPusher``): each layer's tensors are written as one safetensors file in shared memory
  (``/dev/shm``; base64 in the request body when the server is not on this host) and applied by
  ``/collective_rpc`` -> ``gptoss_load_weights``.
- GPU (``NCCLWeightPusher``): non-sink, non-expert tensors go through vLLM's own weight-transfer endpoints
  (``/start_weight_update``, ``/update_weights`` + packed NCCL broadcast, ``/finish_weight_update``; the path
  TRL's ``VLLMClient`` takes); that reload drops sinks and experts exactly as on CPU, so those follow over the
  same NCCL group into ``gptoss_receive_direct_nccl``.
Both end with ``/reset_prefix_cache``: cached KV blocks were computed with the old weights.
Before anything is sent, names and shapes are checked against the served checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import time
from urllib.parse import urlparse

import torch
from safetensors.torch import save, save_file

# the worker-side module imports only torch/safetensors at import time: the one rule for what reload drops
from trl_gptoss.rollout.vllm_worker.gptoss_vllm_worker import loads_directly
from trl_gptoss.rollout.weight_sync import checkpoint_name, grouped_by_layer, pushed_tensors, unwrap

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def collective_rpc(engine, method: str, *args: str, timeout: float = 600.0) -> list:
    """Call an extension method on every vLLM worker; returns one result per worker."""
    answer = engine.request("POST", "/collective_rpc", {"method": method, "args": list(args)}, timeout=timeout)
    return answer["results"]


def check_layout(model, served: dict[str, list[int]]) -> None:
    """Refuse a push whose names or shapes differ from the served checkpoint; the error names the parameter."""
    pushed = {}
    for name, param in unwrap(model).named_parameters():
        target = checkpoint_name(name)
        if target is not None:
            pushed[target] = list(param.shape)
    for name, shape in pushed.items():
        if name not in served:
            raise ValueError(f"weight push: parameter {name!r} does not exist in the served checkpoint")
        if served[name] != shape:
            raise ValueError(f"weight push: parameter {name!r} has shape {shape} but the server expects {served[name]}")
    missing = sorted(set(served) - set(pushed))
    if missing:
        raise ValueError(
            f"weight push: the served checkpoint has {missing[0]!r} which the pushed model lacks "
            f"({len(missing)} missing)"
        )


class HTTPWeightPusher:
    """CPU push over ``/collective_rpc`` (see the module docstring). ``last_push`` holds bytes and seconds."""

    def __init__(self, engine, info: dict):
        self.engine = engine
        self.layout, self.dtype = info["layout"], getattr(torch, info["dtype"])
        local = urlparse(engine.base_url).hostname in _LOCAL_HOSTS
        self.shared_dir = ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) if local else None
        self.last_push: dict = {}

    def push(self, model) -> None:
        check_layout(model, self.layout)
        started, sent = time.perf_counter(), 0
        server_seconds = {"read": 0.0, "reload": 0.0, "direct": 0.0}
        with pushed_tensors(model) as named:
            for group in grouped_by_layer(named):
                tensors = {n: t.detach().to("cpu", self.dtype).contiguous() for n, t in group}
                sent += sum(t.numel() * t.element_size() for t in tensors.values())
                for key, value in self._apply(tensors).items():
                    server_seconds[key] += value
        self.engine.request("POST", "/reset_prefix_cache")
        seconds = time.perf_counter() - started
        self.last_push = {
            "bytes": sent,
            "seconds": seconds,
            "gb_per_s": sent / 1e9 / seconds,
            "server_seconds": server_seconds,
        }

    def _apply(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """Send one group; returns the first worker's time split (read / reload / direct load + repack)."""
        if self.shared_dir is None:
            source = {"b64": base64.b64encode(save(tensors)).decode()}
            results = collective_rpc(self.engine, "gptoss_load_weights", json.dumps(source))
        else:
            fd, path = tempfile.mkstemp(prefix="gptoss-push-", suffix=".safetensors", dir=self.shared_dir)
            os.close(fd)
            try:
                save_file(tensors, path)
                results = collective_rpc(self.engine, "gptoss_load_weights", json.dumps({"path": path}))
            finally:
                os.unlink(path)
        for result in results:
            applied = set(result["reloaded"]) | set(result["direct"])
            if applied != set(tensors):
                raise RuntimeError(f"vLLM worker applied {sorted(applied)} but was sent {sorted(tensors)}")
        return results[0]["seconds"]

    def close(self) -> None:
        pass


class NCCLWeightPusher:
    """GPU push through vLLM's NCCL weight-transfer engine (``--weight-transfer-config {"backend":"nccl"}``).

    The trainer process joins the workers' NCCL group as rank 0 (``init_weight_transfer_engine``); only one
    process (the main one) may push. Untested here (no GPU); see docs/rollouts.md.
    """

    def __init__(self, engine, info: dict, group_port: int = 51216, device: int | str = 0):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.utils.network_utils import get_ip

        self.engine = engine
        self.layout = info["layout"]
        world_size = engine.request("GET", "/get_world_size")["world_size"] + 1
        init_info = {
            "master_address": get_ip(),
            "master_port": group_port,
            "rank_offset": 1,
            "world_size": world_size,
            "packed": True,
        }
        torch.cuda.set_device(torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
        # the server blocks in the rendezvous while answering, so its request runs beside ours
        self.communicator = self._concurrently(
            lambda: engine.request("POST", "/init_weight_transfer_engine", {"init_info": init_info}),
            lambda: trainer_init(init_info),
        )
        self.last_push: dict = {}

    @staticmethod
    def _concurrently(server_call, trainer_call):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(server_call)
            result = trainer_call()
            future.result()
        return result

    def _broadcast(self, server_call, named: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        self._concurrently(
            server_call,
            lambda: packed_nccl_broadcast_producer(
                iterator=iter(named), group=self.communicator, src=0, post_iter_func=lambda item: item[1]
            ),
        )

    def push(self, model) -> None:
        check_layout(model, self.layout)
        started, sent = time.perf_counter(), 0
        with pushed_tensors(model) as named:
            for group in grouped_by_layer(named):
                group = [(n, t.detach().cuda().contiguous()) for n, t in group]
                sent += sum(t.numel() * t.element_size() for _, t in group)
                via_reload = [(n, t) for n, t in group if not loads_directly(n)]
                direct = [(n, t) for n, t in group if loads_directly(n)]
                if via_reload:
                    self.engine.request("POST", "/start_weight_update", {})
                    self._broadcast(
                        lambda g=via_reload: self.engine.request(
                            "POST", "/update_weights", {"update_info": _update_info(g)}
                        ),
                        via_reload,
                    )
                    self.engine.request("POST", "/finish_weight_update", {})
                if direct:
                    self._broadcast(
                        lambda g=direct: collective_rpc(
                            self.engine, "gptoss_receive_direct_nccl", json.dumps(_update_info(g))
                        ),
                        direct,
                    )
        self.engine.request("POST", "/reset_prefix_cache")
        seconds = time.perf_counter() - started
        self.last_push = {"bytes": sent, "seconds": seconds, "gb_per_s": sent / 1e9 / seconds}

    def close(self) -> None:
        self.engine.request("POST", "/shutdown_weight_transfer_engine", {})
        self.communicator = None


def _update_info(named) -> dict:
    return {
        "names": [n for n, _ in named],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }


def weight_pusher_for(engine):
    """NCCL when the server has an NCCL weight-transfer engine and this process a GPU, else the HTTP push.

    One extension call tells both the served layout and the server's transfer backend (``/server_info`` would
    too, but it collects the whole system environment first: ~10 s).
    """
    (info,) = collective_rpc(engine, "gptoss_checkpoint_layout")[:1]
    if info.get("weight_transfer_backend") == "nccl" and torch.cuda.is_available():
        return NCCLWeightPusher(engine, info)
    return HTTPWeightPusher(engine, info)
