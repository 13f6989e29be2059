"""Argument checks shared by every sink-attention backend: bad input fails before any kernel runs."""

from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_cu_seqlens(cu_seqlens, total, device):
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}; use cu_seqlens.to(torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with n_seqs + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}; move it to q's device")
    values = cu_seqlens.tolist()
    if values[0] != 0 or any(b < a for a, b in zip(values[:-1], values[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {values[:8]}...")
    if values[-1] != total:
        raise ValueError(f"cu_seqlens[-1]={values[-1]} must equal the packed token count {total} (q.shape[0])")


def check_sink_attention_inputs(q, k, v, sinks, *, cu_seqlens=None, window=None):
    """Raise ``ValueError`` naming what to change when the tensors do not fit the sink-attention contract."""
    rank = 3 if cu_seqlens is not None else 4
    layout = "[total, H, D] with cu_seqlens" if rank == 3 else "[B, T, H, D]"
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
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA")
    if rank == 4 and (k.shape[0] != q.shape[0] or k.shape[1] < q.shape[1]):
        raise ValueError(
            f"k/v must have q's batch size and at least q's length: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if rank == 3:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"packed q and k must have the same token count, got {q.shape[0]} and {k.shape[0]}")
        _check_cu_seqlens(cu_seqlens, q.shape[0], q.device)
    if sinks is None:
        raise ValueError("sinks is None: sink attention needs one sink logit per query head, a [Hq] tensor")
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (hq,):
        got = getattr(sinks, "shape", None)
        raise ValueError(f"sinks must have shape ({hq},) (one logit per query head), got {got}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ValueError(f"window must be a positive int (the last W tokens including self) or None, got {window!r}")
