"""The process-group push (the default transport): tensors travel by broadcast over a process group that the
pushing rank and the server's workers form (``vllm_worker/gptoss_vllm_transfer.py``: gloo on CPUs, NCCL between
GPUs -- one code path, one backend switch). The trainer imports no vLLM module for it.

Joining: the pushing rank binds a rendezvous socket on the address that routes to the server
(``$TRL_GPTOSS_RENDEZVOUS_HOST`` overrides it; ``$TRL_GPTOSS_RENDEZVOUS_PORT`` asks for a port, another one is
taken and logged when it is in use), draws a fresh token, and tells the server's workers through the
authenticated ``gptoss_join_weight_group`` call where to join (rank ``1 + the worker's rank``). A group outlives
one push; every push first asks the server which group it holds and joins again when it is not ours (the server
restarted, or a failed transfer made it leave).

Each group of tensors (a decoder layer of one pass) is one ``gptoss_receive_weights`` call, running on a thread
beside the broadcasts of the layer's buckets; ``send`` returns once the last bucket is on its way, so the trainer
gathers the next layer while the server takes this one. The server applies a group on a thread of its own while
the next one arrives, and answers each call with the previous group's result: every group is checked one call
later, the last of a pass with ``gptoss_weights_applied`` before the pass ends. What the pushing rank holds beyond
the layer itself: one bucket (``bucket_bytes``) into which the pieces of small tensors (and every layer's last
bucket) are packed; a bucket inside one tensor is sent from the tensor itself. Every wait is bounded by
``timeout_s``: a server that dies or stops answering mid-push is an error naming it, the group is dropped on both
ends and the next push joins anew.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlparse

import torch

from trl_gptoss.rollout.vllm_worker.gptoss_vllm_transfer import (
    TransferError,
    WeightGroup,
    address_towards,
    bind_listener,
    bucket_pieces,
    layer_header,
)
from trl_gptoss.rollout.weights.server_calls import collective_rpc
from trl_gptoss.rollout.weights.server_pusher import ServerWeightPusher

logger = logging.getLogger(__name__)

RENDEZVOUS_HOST_ENV = "TRL_GPTOSS_RENDEZVOUS_HOST"
RENDEZVOUS_PORT_ENV = "TRL_GPTOSS_RENDEZVOUS_PORT"
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_BUCKET_BYTES = 64 << 20
_POLL_S = 0.002


class GroupWeightPusher(ServerWeightPusher):
    """The process-group push to one server (see the module docstring). ``infos``: every worker's answer to
    ``gptoss_checkpoint_layout`` (layout, dtype, device, rank)."""

    transport = "process_group"

    def __init__(
        self,
        engine,
        infos: list[dict],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        super().__init__(engine, infos[0])
        if not timeout_s > 0 or bucket_bytes < 1 << 10:
            raise ValueError(f"timeout_s must be > 0 and bucket_bytes >= 1 KiB, got {timeout_s}, {bucket_bytes}")
        self.world_size = 1 + len(infos)
        self.backend = backend_for(infos)
        nccl = self.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.group: WeightGroup | None = None
        self.group_id: str | None = None
        self.rendezvous: str | None = None  # host:port of the last join
        self._buffer: torch.Tensor | None = None
        self._last_work = None
        self._unchecked: list[list[str]] = []  # names of the groups sent whose application is not checked yet

    def _staging_device(self) -> torch.device:
        return self.device

    # -- joining ------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Make sure the server's workers hold this pusher's group: join when there is none, or when the server
        holds another (it restarted, or left the group after a failed transfer)."""
        if self.group is not None:
            held = set(collective_rpc(self.engine, "gptoss_weight_group", timeout=60.0))
            if held == {self.group_id}:
                return
            logger.warning(
                "weight push: %s holds weight group %s, not %s (restarted?); joining again",
                self.engine.base_url,
                sorted(map(str, held)),
                self.group_id,
            )
            self._drop_group(tell_server=False)
        self._join()

    def _join(self) -> None:
        server_host = urlparse(self.engine.base_url).hostname or "127.0.0.1"
        address = os.environ.get(RENDEZVOUS_HOST_ENV) or address_towards(server_host)
        wanted = int(os.environ.get(RENDEZVOUS_PORT_ENV) or 0)
        listener = bind_listener(address, wanted)
        port = listener.getsockname()[1]
        if wanted and port != wanted:
            logger.warning("weight push: rendezvous port %d is in use on %s; using %d", wanted, address, port)
        token = secrets.token_urlsafe(24)
        group_id = hashlib.sha256(token.encode()).hexdigest()[:16]
        spec = {
            "backend": self.backend,
            "host": address,
            "port": port,
            "token": token,
            "group_id": group_id,
            "rank_offset": 1,
            "world_size": self.world_size,
            "timeout_s": self.timeout_s,
        }
        self.rendezvous = f"{address}:{port}"
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers answer only once every rank has joined
            answer = pool.submit(self._rpc, "gptoss_join_weight_group", json.dumps(spec))
            try:
                group = WeightGroup(
                    backend=self.backend,
                    host=address,
                    port=port,
                    token=token,
                    rank=0,
                    world_size=self.world_size,
                    timeout_s=self.timeout_s,
                    device=self.device,
                    listen=listener,
                )
                answer.result()
            except Exception as exc:
                raise TransferError(
                    f"weight push: the server at {self.engine.base_url} did not join the trainer's {self.backend} "
                    f"weight group at {self.rendezvous} within {self.timeout_s:.0f}s ({_why(exc, answer)}). The "
                    f"server must reach {self.rendezvous}: set ${RENDEZVOUS_HOST_ENV} to this machine's address on "
                    "the servers' network, and open that port (docs/install.md, 'Rendezvous')"
                ) from exc
        self.group, self.group_id = group, group_id

    def _rpc(self, method: str, *args: str):
        return collective_rpc(self.engine, method, *args, timeout=self.timeout_s + 60.0, retries=0)

    # -- one group of tensors ---------------------------------------------------------------------------------
    def begin(self, layout: dict[str, list[int]]) -> None:
        self.connect()  # before the pause: a join never holds up generation
        self._unchecked = []
        super().begin(layout)

    def _collect(self) -> None:
        """Wait for the group in flight; its answer checks the group sent before it (one call behind)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        applied = [answer.get("applied") if isinstance(answer, dict) else answer for answer in pending()]
        self._unchecked.append(self._pending_names)
        if all(result is None for result in applied) and len(self._unchecked) == 1:
            return  # the first group of a pass: nothing was being applied before it
        self._check_applied(applied, self._unchecked.pop(0))

    def end_pass(self, pass_name: str) -> None:
        self._collect()
        if self._unchecked:  # the pass's last group
            self._check_applied(self._rpc("gptoss_weights_applied"), self._unchecked.pop(0))
        super().end_pass(pass_name)

    def _deliver(self, tensors: list[tuple[str, torch.Tensor]]):
        header = {**layer_header(tensors, self.bucket_bytes), "group_id": self.group_id}
        pool = ThreadPoolExecutor(max_workers=1)
        answer = pool.submit(self._rpc, "gptoss_receive_weights", json.dumps(header))
        try:
            self._broadcast(tensors, header, answer)
        except BaseException as exc:
            self._fail(pool, answer, exc)

        def collect() -> list:
            try:
                results = answer.result(timeout=self.timeout_s + 90.0)
                self._wait(self._last_work, answer)
                return results
            except BaseException as exc:
                self._fail(pool, answer, exc)
            finally:
                self._last_work = None
                pool.shutdown(wait=False)

        return collect

    def _broadcast(self, tensors, header: dict, answer: Future) -> None:
        for piece, last in bucket_pieces([t for _, t in tensors], header, self._bucket):
            work = self.group.broadcast(piece)
            if last:
                self._last_work = work
            else:
                self._wait(work, answer)

    def _wait(self, work, answer: Future) -> None:
        """Wait for a broadcast, and stop early when the server's call failed (no worker would receive)."""
        if work is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if answer.done() and answer.exception() is not None:
                raise answer.exception()
            if time.monotonic() > deadline:
                raise TransferError(f"a broadcast to {self.engine.base_url} took longer than {self.timeout_s:.0f}s")
            time.sleep(_POLL_S)
        self.group.wait(work)  # raises the broadcast's own error, if any

    def _bucket(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        return self._buffer

    def _fail(self, pool: ThreadPoolExecutor, answer: Future, exc: BaseException):
        """Drop the group (the workers' receive fails at once instead of at their timeout), let the server's
        call end, raise an error naming the server."""
        self._drop_group(tell_server=False)
        pool.shutdown(wait=False)
        with contextlib.suppress(Exception):  # expected: the call fails with the group gone; the cause is exc
            answer.result(timeout=self.timeout_s + 60.0)
        raise TransferError(
            f"weight push to {self.engine.base_url}: the transfer over the {self.backend} weight group failed "
            f"({type(exc).__name__}: {exc}); the group was dropped and the next push joins again"
        ) from exc

    def _on_abort(self) -> None:
        self._drop_group(tell_server=False)
        self._unchecked = []

    def finish(self) -> None:
        super().finish()
        self._buffer = None  # one bucket for the length of a push, not between pushes

    def _drop_group(self, *, tell_server: bool) -> None:
        group, self.group, self.group_id, self._last_work = self.group, None, None, None
        if group is not None:
            group.close()
        if tell_server:
            try:
                self._rpc("gptoss_leave_weight_group")
            except Exception as exc:  # noqa: BLE001 (closing: a server already gone has nothing to leave)
                logger.info("weight push: %s did not leave its weight group: %s", self.engine.base_url, exc)

    def close(self) -> None:
        if self.group is not None:
            self._drop_group(tell_server=True)


def backend_for(infos: list[dict]) -> str:
    """NCCL when every worker and this process have a GPU and no worker runs on this process's GPU (NCCL refuses
    two ranks on one device: a one-GPU host pushes over gloo); else gloo."""
    if not torch.cuda.is_available() or {info.get("device") for info in infos} != {"cuda"}:
        return "gloo"
    mine = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return "gloo" if any(info.get("gpu") == mine for info in infos) else "nccl"


def _why(exc: BaseException, answer: Future) -> str:
    """The server's own error when its join call failed, else the trainer side's."""
    if answer.done() and answer.exception() is not None:
        exc = answer.exception()
    return f"{type(exc).__name__}: {exc}"
