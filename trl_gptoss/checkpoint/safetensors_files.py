"""Reading a checkpoint's safetensors layout without loading tensors, and writing size-bounded output shards.

``read_header(path)`` parses the header (8-byte little-endian length, then JSON) and checks every tensor's
byte range against its shape, dtype and the file's size, so a truncated or corrupt file is reported by the
tensor it breaks before any tensor is loaded. ``ShardWriter`` holds at most ``max_shard_bytes`` of tensors
(or one tensor, if a single tensor is larger) before writing them out as one shard.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_FLOATING = {"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"}
_MAX_HEADER_BYTES = 100 * 2**20


class CheckpointError(ValueError):
    """A checkpoint that cannot be converted; the message names the file or tensor and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, read from a safetensors header."""

    name: str
    file: Path
    dtype: str  # safetensors dtype string: "BF16", "U8", ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]

    @property
    def is_floating_point(self) -> bool:
        return self.dtype in _FLOATING


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Name -> ``TensorInfo`` of every tensor in the safetensors file ``path``, with byte ranges checked."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, shorter than its header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path} is not a safetensors file: header length {header_len} > file size {size}")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header: not a JSON object")
    data_bytes = size - 8 - header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(path, name, entry, data_bytes)
    return tensors


def _tensor_info(path: Path, name: str, entry, data_bytes: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"tensor {name} in {path}: corrupt header entry {entry!r}") from None
    if dtype not in _ITEMSIZE:
        raise CheckpointError(f"tensor {name} in {path}: unknown dtype {dtype!r}")
    info = TensorInfo(name, path, dtype, shape)
    if end - begin != info.nbytes or not 0 <= begin <= end:
        raise CheckpointError(
            f"tensor {name} in {path}: byte range [{begin}, {end}) does not hold {dtype} {list(shape)} "
            f"({info.nbytes} bytes)"
        )
    if end > data_bytes:
        raise CheckpointError(
            f"tensor {name} in {path}: its bytes end at {end} but the file holds only {data_bytes} data bytes "
            "(truncated download?)"
        )
    return info


class ShardWriter:
    """Collects output tensors and writes them as shards of at most ``max_shard_bytes`` each.

    Shards are written under temporary names while streaming (their count is unknown until the end);
    ``finish()`` renames them to ``model-0000k-of-0000N.safetensors`` (or ``model.safetensors`` when there is
    one) and returns the ``weight_map`` of the index. ``peak_buffered_bytes`` is the most tensor bytes held at
    once.
    """

    def __init__(self, directory: Path, max_shard_bytes: int):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.total_bytes = 0
        self.peak_buffered_bytes = 0
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffered_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []

    def make_room(self, nbytes: int) -> None:
        """Write the buffered shard out first if a tensor of ``nbytes`` would not fit beside it.

        Called before the next tensor is built, so a full buffer and the new tensor are never held together.
        """
        if self._buffer and self._buffered_bytes + nbytes > self.max_shard_bytes:
            self.flush()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.make_room(nbytes)
        self._buffer[name] = tensor.contiguous()
        self._buffered_bytes += nbytes
        self.total_bytes += nbytes
        self.peak_buffered_bytes = max(self.peak_buffered_bytes, self._buffered_bytes)

    def flush(self) -> None:
        if not self._buffer:
            return
        path = self.directory / f".partial-{len(self._shards):05d}.safetensors"
        save_file(self._buffer, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._buffer)))
        self._buffer, self._buffered_bytes = {}, 0

    def discard(self) -> None:
        """Drop the buffer and delete the shards written so far (a failed conversion leaves no partial files)."""
        for path, _ in self._shards:
            path.unlink(missing_ok=True)
        self._shards, self._buffer, self._buffered_bytes = [], {}, 0

    def finish(self) -> dict[str, str]:
        self.flush()
        count = len(self._shards)
        weight_map = {}
        for k, (path, names) in enumerate(self._shards, start=1):
            final = "model.safetensors" if count == 1 else f"model-{k:05d}-of-{count:05d}.safetensors"
            os.replace(path, self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        return weight_map
