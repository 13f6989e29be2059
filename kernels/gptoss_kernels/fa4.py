"""FA4 (``flash-attn-4``, CuTe DSL) dispatch: its ``learnable_sink`` path trains sinks on sm90+ GPUs.

FA4 implements exactly our contract (sink in the softmax denominator, dsink from the backward) for
fp16/bf16, head_dim 64/128, causal, sliding window and varlen. Its sink backward exists only on
SM90/SM100/SM110 (Hopper, Blackwell datacenter), so anything else goes to the package's Triton kernel.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

_FA4_DTYPES = (torch.float16, torch.bfloat16)
_FA4_HEAD_DIMS = (64, 128)
_FA4_ARCH_MAJORS = (9, 10, 11)


def fa4_available() -> bool:
    """True when ``flash_attn.cute`` is importable and the current CUDA device is SM90/SM100/SM110."""
    if not torch.cuda.is_available() or not _fa4_importable():
        return False
    return torch.cuda.get_device_capability()[0] in _FA4_ARCH_MAJORS


@functools.lru_cache(maxsize=1)
def _fa4_importable() -> bool:
    """Looked up once per process: the dispatch asks on every layer call."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    return importlib.util.find_spec("flash_attn.cute") is not None


def fa4_supports(q, window) -> str | None:
    """None when FA4 can run this case, else the reason it cannot (used for the dispatch log)."""
    if not q.is_cuda:
        return "tensors are not on CUDA"
    if q.dtype not in _FA4_DTYPES:
        return f"dtype {q.dtype} (FA4 runs fp16/bf16)"
    if q.shape[-1] not in _FA4_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} (FA4 sink path: 64 or 128)"
    return None


def sink_attention_fa4(q, k, v, sinks, *, cu_seqlens=None, max_seqlen=None, window=None, scale=None):
    """Causal sink attention through FA4. Layouts as ``sink_attention``; returns o like q.

    FA4's causal mask is bottom-right aligned (queries are the last Tq keys), its window ``(left, right)``
    counts keys excluding self, so GPT-OSS's "last W tokens including self" is ``(W - 1, 0)``.
    """
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    window_size = (window - 1, 0) if window is not None else (None, None)
    common = dict(softmax_scale=scale, causal=True, window_size=window_size, learnable_sink=sinks.float())
    if cu_seqlens is None:
        out = flash_attn_func(q, k, v, **common)
    else:
        out = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            **common,
        )
    return out[0] if isinstance(out, tuple) else out
