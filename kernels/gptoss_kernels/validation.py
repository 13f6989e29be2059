"""Argument checks of the public sink-attention entries (bad input fails before any kernel runs), and the
one capability rule "what the Triton kernel can run" shared by dispatch and the Triton entry point.

Validating ``cu_seqlens`` needs its values on the host (one device->host copy). The result is remembered
per tensor object (``tensor_cache.TensorCache``: invalidated by any in-place write, inference tensors
included), so a layout built once per step and handed to every layer is read back once, not once per layer.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from gptoss_kernels.tensor_cache import TensorCache

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_HEAD_DIM = 128
INT32_MAX = 2**31 - 1


class CuSeqlensInfo(NamedTuple):
    """What validation learned about a ``cu_seqlens`` tensor: its host copy and longest document."""

    bounds: tuple[int, ...]
    longest: int


# Validated cu_seqlens per tensor object (see tensor_cache.py: invalidated by any in-place write).
_VALIDATED = TensorCache(size=16)


def _check_cu_seqlens_values(cu_seqlens: torch.Tensor) -> CuSeqlensInfo:
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}; use cu_seqlens.to(torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with n_seqs + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    values = tuple(cu_seqlens.tolist())
    if values[0] != 0 or any(b < a for a, b in zip(values[:-1], values[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {list(values[:8])}...")
    return CuSeqlensInfo(values, max(b - a for a, b in zip(values[:-1], values[1:])))


def cu_seqlens_info(cu_seqlens: torch.Tensor, total: int) -> CuSeqlensInfo:
    """Check ``cu_seqlens`` (int32, 1-D, from 0, non-decreasing, ending at ``total``); cached per tensor."""
    info = _VALIDATED.get(cu_seqlens, None, lambda: _check_cu_seqlens_values(cu_seqlens))
    if info.bounds[-1] != total:
        raise ValueError(f"cu_seqlens[-1]={info.bounds[-1]} must equal the packed token count {total} (q.shape[0])")
    return info


def check_tensors(q, k, v, rank, layout):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            raise ValueError(f"{name} must be a {rank}-D tensor {layout}, got shape {getattr(t, 'shape', None)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; expected one of float16/bfloat16/float32/float64")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share a device")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head_dim differ: {q.shape[-1]} vs {k.shape[-1]}")
    if q.shape[-1] == 0:
        raise ValueError("head_dim is 0: q, k and v need at least one feature per head (shape [..., H, D>=1])")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA")


def check_sinks(sinks, hq, device):
    if sinks is None:
        raise ValueError("sinks is None: sink attention needs one sink logit per query head, a [Hq] tensor")
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (hq,):
        got = getattr(sinks, "shape", None)
        raise ValueError(f"sinks must have shape ({hq},) (one logit per query head), got {got}")
    if not sinks.is_floating_point():
        raise ValueError(
            f"sinks has dtype {sinks.dtype}; sink logits must be a floating-point tensor (use sinks.float())"
        )
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}")


def _check_key_mask(key_mask, k):
    if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool:
        raise ValueError(
            f"key_mask must be a bool tensor [B, Tk] (True = valid key), got "
            f"{getattr(key_mask, 'dtype', type(key_mask))}"
        )
    if key_mask.shape != k.shape[:2]:
        raise ValueError(f"key_mask must have shape [B, Tk] = {tuple(k.shape[:2])}, got {tuple(key_mask.shape)}")
    if key_mask.device != k.device:
        raise ValueError(f"key_mask is on {key_mask.device} but k is on {k.device}")


def check_window(window):
    if window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"window must be a positive int (the last W tokens including self) or None, got {window!r}")
    if window > INT32_MAX:
        raise ValueError(
            f"window={window} does not fit int32; a window at least as long as the sequence is "
            "full causal attention: pass window=None"
        )


def check_scale(scale):
    if scale is None:
        return
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number (default head_dim ** -0.5), got {scale!r}")


def check_sink_attention_inputs(
    q, k, v, sinks, *, cu_seqlens=None, max_seqlen=None, window=None, key_mask=None, scale=None
):
    """Raise ``ValueError`` naming what to change when the tensors do not fit the sink-attention contract.

    Returns the ``CuSeqlensInfo`` of a packed layout (None for batched) so callers need not read it again.
    """
    rank = 3 if cu_seqlens is not None else 4
    layout = "[total, H, D] with cu_seqlens" if rank == 3 else "[B, T, H, D]"
    check_tensors(q, k, v, rank, layout)
    check_sinks(sinks, q.shape[-2], q.device)
    check_window(window)
    check_scale(scale)
    if rank == 4:
        if k.shape[0] != q.shape[0] or k.shape[1] < q.shape[1]:
            raise ValueError(
                f"k/v must have q's batch size and at least q's length: q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        if key_mask is not None:
            _check_key_mask(key_mask, k)
        return None
    if key_mask is not None:
        raise ValueError("key_mask is for the batched layout [B, T, H, D]; a packed layout has no padding")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"packed q and k must have the same token count, got {q.shape[0]} and {k.shape[0]}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}; move it to q's device")
    info = cu_seqlens_info(cu_seqlens, q.shape[0])
    if max_seqlen is not None and (
        not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < info.longest
    ):
        raise ValueError(
            f"max_seqlen must be an int >= the longest document in cu_seqlens ({info.longest}), "
            f"got {max_seqlen!r}; pass None to have it computed"
        )
    return info


def check_cross_lengths(q, k, v, sinks, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k, window):
    """Packed queries ``[total_q, Hq, D]`` over longer packed key documents ``[total_k, Hkv, D]``: the same
    number of documents, each with at least as many keys as queries (its queries are its last positions)."""
    check_tensors(q, k, v, 3, "[total, H, D] with cu_seqlens")
    check_sinks(sinks, q.shape[-2], q.device)
    check_window(window)
    for name, cu in (("cu_seqlens", cu_seqlens), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}; move it to q's device")
    info_q = cu_seqlens_info(cu_seqlens, q.shape[0])
    info_k = cu_seqlens_info(cu_seqlens_k, k.shape[0])
    if len(info_q.bounds) != len(info_k.bounds):
        raise ValueError(
            f"cu_seqlens and cu_seqlens_k must describe the same number of documents, got "
            f"{len(info_q.bounds) - 1} and {len(info_k.bounds) - 1}"
        )
    pairs = zip(zip(info_q.bounds, info_q.bounds[1:]), zip(info_k.bounds, info_k.bounds[1:]))
    if any(qb - qa > kb - ka for (qa, qb), (ka, kb) in pairs):
        raise ValueError(
            "every document needs at least as many keys as queries (queries are its last "
            "positions): cu_seqlens_k lengths must be >= cu_seqlens lengths"
        )
    for name, value, info in (("max_seqlen", max_seqlen, info_q), ("max_seqlen_k", max_seqlen_k, info_k)):
        if value is None or value < info.longest:
            raise ValueError(f"{name} must be an int >= the longest document ({info.longest}), got {value!r}")
    return info_q, info_k


def triton_unsupported(q, k, cu_seqlens, key_mask=None, interpreter_ok=False) -> str | None:
    """None when the Triton kernel can run this case, else why not. The one rule for dispatch and launchers.

    CPU tensors count only under ``TRITON_INTERPRET=1`` (tests) and only when ``interpreter_ok``.
    """
    if not q.is_cuda and not (interpreter_ok and os.environ.get("TRITON_INTERPRET") == "1"):
        return "tensors are not on CUDA (on CPU, backend='triton' needs TRITON_INTERPRET=1 set before import)"
    if key_mask is not None:
        return "a key_mask (padding holes) is taken by the chunked path"
    if q.dtype not in _TRITON_DTYPES:
        return f"the Triton kernel takes fp16/bf16/fp32, not {q.dtype}"
    if q.shape[-1] > TRITON_MAX_HEAD_DIM:
        return f"the Triton kernel takes head_dim <= {TRITON_MAX_HEAD_DIM}, not {q.shape[-1]}"
    return None
