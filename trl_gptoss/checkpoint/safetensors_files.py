"""Reading a checkpoint's safetensors layout without loading tensors, and writing size-bounded output shards.

``read_header(path)`` parses the header (8-byte little-endian length, then JSON) and checks it as the
safetensors format requires: every entry a ``dtype``, a ``shape`` of non-negative integers and two integer
``data_offsets`` whose range holds exactly that many bytes, the ranges contiguous from 0 and covering the
data to the file's end (no gap, no overlap, nothing after), ``__metadata__`` text to text. A truncated or
corrupt file is reported by the tensor it breaks before any tensor is loaded. ``ShardWriter`` holds at most
``max_shard_bytes`` of tensors (or one tensor, if a single tensor is larger) before writing them out as one
shard.
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


def read_json(path: Path, what: str):
    """``path`` parsed as JSON; ``CheckpointError`` naming it when it cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_bytes())
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the {what}: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nesting past the stack
        raise CheckpointError(f"{path} is not a valid JSON {what}: {str(exc)[:200]}") from None


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Name -> ``TensorInfo`` of every tensor in the safetensors file ``path``, with byte ranges checked."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, shorter than its header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(
                    f"{path} is not a safetensors file: header length {header_len} > file size {size}"
                )
            text = handle.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it: {exc}") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} has a corrupt safetensors header: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header: not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path} has a corrupt safetensors header: __metadata__ is not text to text")
    data_bytes = size - 8 - header_len
    tensors = {name: _tensor_info(path, name, entry, data_bytes) for name, entry in header.items()}
    _check_contiguous(path, tensors, header, data_bytes)
    return tensors


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_info(path: Path, name: str, entry, data_bytes: int) -> TensorInfo:
    try:
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (TypeError, KeyError):
        raise CheckpointError(f"tensor {name} in {path}: corrupt header entry {str(entry)[:200]}") from None
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise CheckpointError(f"tensor {name} in {path}: unknown dtype {str(dtype)[:50]!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"tensor {name} in {path}: shape {str(shape)[:200]} is not a list of integers >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise CheckpointError(f"tensor {name} in {path}: data_offsets {str(offsets)[:200]} are not two integers >= 0")
    begin, end = offsets
    info = TensorInfo(name, path, dtype, tuple(shape))
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


def _check_contiguous(path: Path, tensors: dict[str, TensorInfo], header: dict, data_bytes: int) -> None:
    """The tensors' byte ranges follow each other from 0 to the end of the data, as safetensors requires."""
    position, previous = 0, None
    for name in sorted(tensors, key=lambda n: tuple(header[n]["data_offsets"])):
        begin, end = header[name]["data_offsets"]
        if begin != position:
            what = f"a gap of {begin - position} bytes" if begin > position else f"{position - begin} bytes overlap"
            after = f"after tensor {previous}" if previous else "at the start of the data"
            raise CheckpointError(f"tensor {name} in {path}: {what} {after} (corrupt header)")
        position, previous = end, name
    if position != data_bytes:
        raise CheckpointError(
            f"{path}: the tensors end at byte {position} but the file holds {data_bytes} data bytes "
            "(trailing data: corrupt or not a safetensors file)"
        )


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

    def finish(self) -> dict[str, str]:
        self.flush()
        count = len(self._shards)
        weight_map = {}
        for k, (path, names) in enumerate(self._shards, start=1):
            final = "model.safetensors" if count == 1 else f"model-{k:05d}-of-{count:05d}.safetensors"
            os.replace(path, self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        return weight_map
