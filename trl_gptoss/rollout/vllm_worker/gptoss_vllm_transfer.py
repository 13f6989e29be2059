"""The weight transfer both ends own: a torch process group that is neither side's default group.

Imported by the trainer (``trl_gptoss.rollout.weights.group_push``) and by the worker extension inside vLLM
(``gptoss_vllm_worker``), so it imports only the standard library and torch. One code path, one backend switch:
NCCL between GPUs, gloo otherwise (CPU servers, or a trainer without a GPU).

Rendezvous: the pushing rank is rank 0. It listens with a ``torch.distributed.TCPStore`` on a socket it bound
itself, to the address the servers reach it by; every key lives under ``trl-gptoss/<token>/``, a fresh random
token per join that reaches the servers only inside the authenticated ``/collective_rpc`` call telling them to
join. A peer without the token can open a connection to the store but cannot read or write the group's keys, so
it cannot take a rank. All ranks then run a one-element all-reduce (its sum proves every rank took part; NCCL
also needs one collective before the first broadcast to build its communicator on every rank at the same time).

Wire format of one group of tensors (a decoder layer): the tensors' bytes laid end to end, each starting at a
multiple of ``ALIGN`` bytes, cut into buckets of at most ``bucket_bytes``; each bucket is one broadcast from
rank 0 of a ``uint8`` tensor. The header (``layer_header``) travels in the RPC that tells the server to
receive, so both ends cut the same buckets.
"""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

ALIGN = 64  # bytes: every tensor starts here, so a uint8 slice can be viewed as any dtype
KEY_PREFIX = "trl-gptoss"
BACKENDS = ("gloo", "nccl")


class TransferError(RuntimeError):
    """The process group could not be formed, or a broadcast failed or timed out."""


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent: a UDP ``connect`` only picks the
    route). Loopback for a loopback peer."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host.strip("[]"), 9))
        except OSError as exc:
            raise TransferError(f"no route from this machine to {host!r}: {exc}") from None
        return probe.getsockname()[0]


def layer_header(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict:
    """Where each tensor's bytes lie in the group's stream, and the bucket size both ends cut it with."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
    offsets, total = [], 0
    for _, tensor in named:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return {
        "names": [n for n, _ in named],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "offsets": offsets,
        "total": total,
        "bucket_bytes": bucket_bytes,
    }


def buckets(header: dict) -> list[tuple[int, int]]:
    """``[lo, hi)`` byte ranges of the stream, one broadcast each."""
    size, total = header["bucket_bytes"], header["total"]
    return [(lo, min(lo + size, total)) for lo in range(0, total, size)]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat ``uint8`` view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def bucket_pieces(tensors: list[torch.Tensor], header: dict, buffer):
    """Rank 0's side of ``buckets``: yields ``(piece, last)`` per bucket, in order, each to be broadcast before the
    next is asked for. A bucket that lies inside one tensor is a view of it; the others, and always the last one,
    are packed into ``buffer()`` (one bucket's bytes, reused: so a last bucket still in flight never keeps the
    group's tensors alive)."""
    spans = [(offset, as_bytes(t)) for offset, t in zip(header["offsets"], tensors)]
    ranges = buckets(header)
    for index, (lo, hi) in enumerate(ranges):
        last = index == len(ranges) - 1
        piece = None if last else _inside_one_tensor(spans, lo, hi)
        if piece is None:
            piece = buffer()[: hi - lo]
            _pack(spans, lo, hi, piece)
        yield piece, last


def _inside_one_tensor(spans, lo: int, hi: int) -> torch.Tensor | None:
    """The bytes ``[lo, hi)`` of the stream as a view of the one tensor holding all of them, if one does."""
    for offset, data in spans:
        if offset <= lo and hi <= offset + data.numel():
            return data[lo - offset : hi - offset]
    return None


def _pack(spans, lo: int, hi: int, out: torch.Tensor) -> None:
    """Copy the bytes ``[lo, hi)`` of the stream into ``out`` (the alignment padding is left as it is)."""
    for offset, data in spans:
        start, end = max(lo, offset), min(hi, offset + data.numel())
        if start < end:
            out[start - lo : end - lo].copy_(data[start - offset : end - offset])


def unpack(flat: torch.Tensor, header: dict) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a received stream, as views of ``flat``."""
    named = []
    for name, dtype, shape, offset in zip(header["names"], header["dtypes"], header["shapes"], header["offsets"]):
        dtype = getattr(torch, dtype)
        count = 1
        for dim in shape:
            count *= dim
        size = count * torch.empty((), dtype=dtype).element_size()
        named.append((name, flat[offset : offset + size].view(dtype).view(shape)))
    return named


class WeightGroup:
    """One process group of the transfer: rank 0 sends, every other rank receives. ``listen`` (rank 0 only): the
    bound, listening socket the store serves on (``bind_listener``)."""

    def __init__(
        self,
        *,
        backend: str,
        host: str,
        port: int,
        token: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        device: torch.device,
        listen: socket.socket | None = None,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if (rank == 0) != (listen is not None):
            raise ValueError("rank 0 serves the rendezvous (give it the listening socket); other ranks join it")
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        where = f"{backend} weight group at {host}:{port} (rank {rank} of {world_size})"
        try:
            self._store = self._rendezvous(host, port, listen)
            prefixed = dist.PrefixStore(f"{KEY_PREFIX}/{token}/", self._store)
            self._group = self._process_group(prefixed, host)
            self._check_everyone_joined()
        except Exception as exc:
            raise TransferError(f"{where}: could not be formed ({type(exc).__name__}: {exc})") from exc
        self.where = where

    def _rendezvous(self, host: str, port: int, listen: socket.socket | None):
        if listen is None:
            return dist.TCPStore(host, port, None, False, self.timeout)
        fd = listen.detach()  # the store owns it from here
        return dist.TCPStore(host, port, None, True, self.timeout, wait_for_workers=False, master_listen_fd=fd)

    def _process_group(self, store, host: str):
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return dist.ProcessGroupNCCL(store, self.rank, self.world_size, options)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        # gloo's own connections leave from (and listen on) the address that reaches the rendezvous host
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address_towards(host))]
        return dist.ProcessGroupGloo(store, self.rank, self.world_size, options)

    def _check_everyone_joined(self) -> None:
        one = torch.ones(1, device=self.device)
        self._group.allreduce([one]).wait(self.timeout)
        if int(one.item()) != self.world_size:
            raise TransferError(f"the warm-up all-reduce summed to {one.item()}, not the world size")

    def broadcast(self, tensor: torch.Tensor):
        """Start a broadcast of ``tensor`` from rank 0 (sent on rank 0, received in place elsewhere); returns
        the work to ``wait`` on."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self._group.broadcast([tensor], options)

    def wait(self, work) -> None:
        try:
            work.wait(self.timeout)
        except Exception as exc:
            raise TransferError(f"{self.where}: broadcast failed ({type(exc).__name__}: {exc})") from exc

    def receive(self, header: dict) -> list[tuple[str, torch.Tensor]]:
        """A rank > 0: receive one group of tensors (``layer_header``) into a fresh buffer on ``device``."""
        flat = torch.empty(header["total"], dtype=torch.uint8, device=self.device)
        for lo, hi in buckets(header):
            self.wait(self.broadcast(flat[lo:hi]))
        return unpack(flat, header)

    def close(self) -> None:
        group, self._group = getattr(self, "_group", None), None
        if group is not None and hasattr(group, "shutdown"):
            with contextlib.suppress(Exception):  # a group its peer already broke has nothing left to shut down
                group.shutdown()
        self._store = None


def bind_listener(address: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``address``: ``port`` when given and free, else one the kernel picks."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((address, port))
    except OSError:
        if not port:
            listener.close()
            raise
        listener.bind((address, 0))  # the caller compares the port it asked for with the one it got
    listener.listen(128)
    return listener
