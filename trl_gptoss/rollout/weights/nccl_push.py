"""GPU weight push through vLLM's NCCL weight-transfer engine (``--weight-transfer-config {"backend":"nccl"}``).

One push (driven by ``sync.push_model``): ``/pause?mode=wait`` (requests in flight finish first),
``/start_weight_update`` once, one ``/update_weights`` + packed broadcast per layer for what vLLM's reload
applies, ``/finish_weight_update`` once (one reload session, so vLLM parks and re-materialises the model
once, not once per layer), then one ``gptoss_receive_direct_nccl`` + broadcast per layer for the sinks and
experts that reload drops, ``/reset_prefix_cache`` (checked), ``/resume``.

A call coupled to a broadcast runs beside it on a thread and is never retried: a retried ``/update_weights``
would wait forever for a broadcast the trainer already made. When it fails before the broadcast starts the
broadcast is skipped; when it or the broadcast fails, the transfer group is torn down (the next push builds a
new one) and the error names the call. The trainer's tensors are cast to the server's dtype before they are
sent, and the default CUDA stream is synchronised before vLLM's packing streams read them.
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from trl_gptoss.rollout.weights.names import check_layout
from trl_gptoss.rollout.weights.server_calls import collective_rpc, reset_prefix_cache

COUPLED_TIMEOUT = 600.0  # seconds a coupled server call may take after its broadcast was sent
# The packing both ends must agree on, sent in the init info rather than left to each side's vLLM default (the
# trainer's vLLM and the server's may differ; 0.32 and 0.33 both default to 1 GiB x 2).
PACKED_BUFFER_BYTES = 1 << 30
PACKED_NUM_BUFFERS = 2


class NCCLTransferError(RuntimeError):
    """A call coupled to an NCCL broadcast failed; the transfer group was torn down."""


class VLLMNCCLGroup:
    """The trainer's end of a vLLM NCCL weight-transfer group: rank 0 of ``1 + server workers`` ranks."""

    def __init__(self, engine, port: int, device: int | str = 0):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.utils.network_utils import get_ip

        torch.cuda.set_device(torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
        world_size = engine.request("GET", "/get_world_size")["world_size"] + 1
        init_info = {  # vLLM's NCCLWeightTransferInitInfo (keyword-only; tests/rollout/test_vllm_api.py)
            "master_address": get_ip(),
            "master_port": port,
            "rank_offset": 1,
            "world_size": world_size,
            "packed": True,
            "packed_buffer_size_bytes": PACKED_BUFFER_BYTES,
            "packed_num_buffers": PACKED_NUM_BUFFERS,
        }
        with ThreadPoolExecutor(max_workers=1) as pool:  # the server blocks in the rendezvous while answering
            future = pool.submit(
                engine.request, "POST", "/init_weight_transfer_engine", {"init_info": init_info}, retries=0
            )
            self.communicator = trainer_init(init_info)
            future.result()

    def broadcast(self, named: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        torch.cuda.current_stream().synchronize()  # the packing runs on side streams that do not wait for ours
        packed_nccl_broadcast_producer(
            iterator=iter(named),
            group=self.communicator,
            src=0,
            post_iter_func=lambda item: item[1],
            buffer_size_bytes=PACKED_BUFFER_BYTES,
            num_buffers=PACKED_NUM_BUFFERS,
        )

    def close(self) -> None:
        self.communicator = None


def update_info(named) -> dict:
    return {
        "names": [n for n, _ in named],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }


class NCCLWeightPusher:
    """GPU pusher for one server (see the module docstring). ``make_group()`` builds the transfer group (a
    ``VLLMNCCLGroup`` by default; tests pass a fake with ``broadcast(named)`` and ``close()``). ``device``: where
    the sent tensors are staged (the trainer's GPU)."""

    passes = ("reload", "direct")

    def __init__(self, engine, info: dict, *, make_group=None, port: int | None = None, device: int | str = 0):
        from trl_gptoss.rollout.server import free_port

        self.engine = engine
        self.layout, self.dtype = info["layout"], getattr(torch, info["dtype"])
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        port = port or free_port()
        self._make_group = make_group or (lambda: VLLMNCCLGroup(engine, port, device))
        self.group = None
        self._paused = self._session = self._released = False
        self.last_push: dict = {}

    # -- one push -------------------------------------------------------------------------------------
    def begin(self, layout: dict[str, list[int]]) -> None:
        check_layout(layout, self.layout, self.engine.base_url)
        if self.group is None:
            self.group = self._make_group()
        self._started, self._sent = time.perf_counter(), 0
        self.engine.request("POST", "/pause?mode=wait")
        self._paused = True
        self.engine.request("POST", "/start_weight_update", retries=0)  # no body: the route takes none
        self._session = True

    def send(self, pass_name: str, group: list[tuple[str, torch.Tensor]]) -> None:
        named = [(n, t.detach().to(self.device, self.dtype).contiguous()) for n, t in group]  # server dtype
        self._sent += sum(t.numel() * t.element_size() for _, t in named)
        info = update_info(named)
        if pass_name == "reload":
            call = "/update_weights"

            def server_call():
                return self.engine.request("POST", "/update_weights", {"update_info": info}, retries=0)
        else:
            call = "gptoss_receive_direct_nccl"

            def server_call():
                return collective_rpc(self.engine, call, json.dumps(info), retries=0)

        self._coupled(call, server_call, named)

    def end_pass(self, pass_name: str) -> None:
        if pass_name == "reload":
            self.engine.request("POST", "/finish_weight_update", retries=0)  # weight_version is optional
            self._session = False

    def finish(self) -> None:
        reset_prefix_cache(self.engine)
        self.engine.request("POST", "/resume")
        self._paused = False
        seconds = time.perf_counter() - self._started
        self.last_push = {"bytes": self._sent, "seconds": seconds, "gb_per_s": self._sent / 1e9 / seconds}

    def abort(self) -> None:
        """After a failed push: close an open reload session, release a torn-down group's server end (vLLM
        refuses that while a session is open), let the server generate again."""
        steps = (
            (self._session, "/finish_weight_update"),
            (self._released, "/shutdown_weight_transfer_engine"),
            (self._paused, "/resume"),
        )
        for needed, path in steps:
            if needed:
                with contextlib.suppress(Exception):  # the push's own error is what gets raised
                    self.engine.request("POST", path, retries=0)
        self._session = self._paused = self._released = False

    # -- coupled calls --------------------------------------------------------------------------------
    def _coupled(self, call: str, server_call, named) -> None:
        """``server_call`` on a thread beside the broadcast of ``named``; both must succeed."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(server_call)
            try:
                if future.done() and future.exception() is not None:
                    raise future.exception()  # the server will not receive: broadcasting would hang
                self.group.broadcast(named)
                future.result(timeout=COUPLED_TIMEOUT)
            except BaseException as exc:
                self._tear_down()
                raise NCCLTransferError(
                    f"weight push to {self.engine.base_url}: {call} failed ({type(exc).__name__}: {exc}); the NCCL "
                    "transfer group was torn down and the next push builds a new one"
                ) from exc

    def _tear_down(self) -> None:
        """Drop the trainer's end now; ``abort`` releases the server's end once the session is closed."""
        if self.group is not None:
            self.group.close()
            self.group = None
        self._released = True

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
            self.engine.request("POST", "/shutdown_weight_transfer_engine", retries=0)
