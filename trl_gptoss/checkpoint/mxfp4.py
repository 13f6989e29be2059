"""MXFP4 (OCP microscaling FP4) as GPT-OSS hub checkpoints store their experts, and its exact dequantisation.

Hub layout of one expert projection ``P`` (``gate_up_proj`` or ``down_proj``), for ``E`` experts, ``R`` output
rows and ``C = 32 * G`` input columns:

- ``P_blocks``: ``uint8 [E, R, G, 16]``. Each byte packs two FP4 (E2M1) codes; the low nibble is the even
  element, the high nibble the odd one, so a 16-byte block holds the 32 elements of one scaling block in order.
- ``P_scales``: ``uint8 [E, R, G]``, one E8M0 exponent per 32-element block, biased by 127
  (``scale = 2 ** (byte - 127)``; the byte 255 is NaN in E8M0 and never a valid scale).

Element ``w[e, r, 32 * g + j] = E2M1[code(e, r, g, j)] * 2 ** (scales[e, r, g] - 127)``, where ``E2M1`` is the
16-entry table below (sign bit 3, exponent bits 2-1, mantissa bit 0). The row-major ``[E, R, C]`` result is the
transpose of transformers' ``GptOssExperts`` parameters: ``gate_up_proj [E, H, 2I]`` (``R = 2I``, ``C = H``,
gate and up interleaved along the last axis exactly as on disk) and ``down_proj [E, I, H]`` (``R = H``,
``C = I``). Every E2M1 value times a power of two in bfloat16's or float32's exponent range is exact in
that dtype, so dequantising to either loses nothing.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32  # elements per E8M0 scale
BYTES_PER_BLOCK = BLOCK_SIZE // 2
E8M0_BIAS = 127
E8M0_NAN = 255

# E2M1 code -> value: codes 0-7 are +{0, 0.5, 1, 1.5, 2, 3, 4, 6}, codes 8-15 the same magnitudes negated.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _E2M1_MAGNITUDES + tuple(-m for m in _E2M1_MAGNITUDES)

EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


class MXFP4FormatError(ValueError):
    """A checkpoint tensor that is not valid GPT-OSS MXFP4 (the message names the tensor)."""


def check_mxfp4_pair(name: str, blocks_shape, blocks_dtype, scales_shape, scales_dtype) -> tuple[int, int, int]:
    """Validate the shapes and dtypes of ``name``'s blocks and scales; return ``(E, R, C)`` of the result.

    ``blocks_dtype`` / ``scales_dtype`` are torch dtypes or safetensors dtype strings (``"U8"``).
    """
    for suffix, dtype in (("_blocks", blocks_dtype), ("_scales", scales_dtype)):
        if dtype not in (torch.uint8, "U8"):
            raise MXFP4FormatError(f"{name}{suffix} has dtype {dtype}; MXFP4 {suffix[1:]} must be uint8 (U8)")
    blocks_shape, scales_shape = tuple(blocks_shape), tuple(scales_shape)
    if len(blocks_shape) != 4 or blocks_shape[-1] != BYTES_PER_BLOCK:
        raise MXFP4FormatError(
            f"{name}_blocks has shape {list(blocks_shape)}; expected [experts, rows, groups, {BYTES_PER_BLOCK}]"
        )
    if scales_shape != blocks_shape[:-1]:
        raise MXFP4FormatError(
            f"{name}_scales has shape {list(scales_shape)} but {name}_blocks {list(blocks_shape)} needs "
            f"{list(blocks_shape[:-1])} (one scale per {BLOCK_SIZE}-element block)"
        )
    experts, rows, groups, _ = blocks_shape
    return experts, rows, groups * BLOCK_SIZE


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16, name: str = "tensor"
) -> torch.Tensor:
    """Hub ``blocks: uint8 [E, R, G, 16]`` and ``scales: uint8 [E, R, G]`` -> ``[E, C, R]`` in ``dtype``.

    ``C = 32 * G``. The result is laid out as transformers' ``GptOssExperts`` parameter (see the module
    docstring). Work is done one expert at a time in float32 (exact: E2M1 values times powers of two), so the
    temporaries stay at one expert's size. ``name`` is only used in error messages.
    """
    experts, rows, cols = check_mxfp4_pair(name, blocks.shape, blocks.dtype, scales.shape, scales.dtype)
    if bool((scales == E8M0_NAN).any()):
        raise MXFP4FormatError(f"{name}_scales holds the byte {E8M0_NAN}, which is NaN in E8M0 (corrupt scales)")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    out = torch.empty(experts, cols, rows, dtype=dtype)
    for e in range(experts):
        packed = blocks[e].to(torch.int64)  # [R, G, 16]
        codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [R, G, 16, 2]: low nibble first
        values = table[codes].reshape(rows, cols // BLOCK_SIZE, BLOCK_SIZE) * e8m0_to_float32(scales[e]).unsqueeze(-1)
        if not bool(values.isfinite().all()):
            raise MXFP4FormatError(f"{name} overflows float32 in expert {e}: its scales are too large (corrupt)")
        out[e].copy_(values.reshape(rows, cols).t())
    return out


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """``uint8`` E8M0 bytes -> ``2 ** (byte - 127)`` as float32, exactly.

    E8M0 and float32 share the exponent bias 127, so the byte shifted into float32's exponent field is the
    power of two itself; the byte 0 (``2 ** -127``) is float32's subnormal with only mantissa bit 22 set.
    """
    bits = scales.to(torch.int32) << 23
    bits = torch.where(scales == 0, torch.full_like(bits, 1 << 22), bits)
    return bits.view(torch.float32)
