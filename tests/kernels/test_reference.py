"""Pin ``sink_attention_ref`` to upstream: transformers' GPT-OSS eager attention and the sigmoid form."""

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from gptoss_kernels import sink_attention_ref

F64 = torch.float64


def _allowed(tq, tk, window):
    """Bool [Tq, Tk]: bottom-right aligned causal mask, optionally the last ``window`` keys including self."""
    q_pos = torch.arange(tk - tq, tk)[:, None]
    k_pos = torch.arange(tk)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def _eager(q, k, v, sinks, window):
    """transformers' GPT-OSS ``eager_attention_forward`` on [B, T, H, D] inputs with an additive mask."""
    hq, hkv = q.shape[2], k.shape[2]
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=hq // hkv, training=False)
    mask = torch.zeros(q.shape[1], k.shape[1], dtype=q.dtype)
    mask = mask.masked_fill(~_allowed(q.shape[1], k.shape[1], window), float("-inf"))
    out, _ = eager_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[None, None], scaling=q.shape[-1] ** -0.5
    )
    return out


def _plain_attention(q, k, v, window):
    """Sink-free attention written independently: o_plain and lse_plain per row, [B, Tq, Hq, *]."""
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~_allowed(q.shape[1], k.shape[1], window), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), vr)
    return out, lse.transpose(1, 2)


def _inputs(batch, tq, tk, hq, hkv, dim=16, sink_scale=2.0):
    q = torch.randn(batch, tq, hq, dim, dtype=F64)
    k, v = (torch.randn(batch, tk, hkv, dim, dtype=F64) for _ in range(2))
    sinks = torch.randn(hq, dtype=F64) * sink_scale
    return q, k, v, sinks


CASES = {
    "b2-t37-gqa2-full": (2, 37, 37, 4, 2, None),
    "b2-t37-gqa2-w5": (2, 37, 37, 4, 2, 5),
    "b1-t20-gqa8-w1": (1, 20, 20, 8, 1, 1),
    "b2-t19-gqa1-w64": (2, 19, 19, 2, 2, 64),
    "decode-b2-tq3-tk29-w7": (2, 3, 29, 4, 2, 7),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_matches_transformers_eager_float64(case):
    batch, tq, tk, hq, hkv, window = case
    q, k, v, sinks = _inputs(batch, tq, tk, hq, hkv)
    ours = sink_attention_ref(q, k, v, sinks, window=window)
    theirs = _eager(q, k, v, sinks, window)
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-10, f"reference vs transformers eager: max|diff|={diff:.3e}"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_matches_sigmoid_form(case):
    """o = o_plain * sigmoid(lse_plain - s) and lse = logaddexp(lse_plain, s)."""
    batch, tq, tk, hq, hkv, window = case
    q, k, v, sinks = _inputs(batch, tq, tk, hq, hkv)
    out, lse = sink_attention_ref(q, k, v, sinks, window=window, return_lse=True)
    o_plain, lse_plain = _plain_attention(q, k, v, window)
    expected = o_plain * torch.sigmoid(lse_plain - sinks)[..., None]
    assert (out - expected).abs().max().item() <= 1e-10
    assert (lse - torch.logaddexp(lse_plain, sinks)).abs().max().item() <= 1e-10


def test_reference_varlen_equals_documents_alone():
    lengths = [1, 0, 13, 7]
    cu_seqlens = torch.tensor([0, 1, 1, 14, 21], dtype=torch.int32)
    q, k, v, sinks = _inputs(1, 21, 21, 4, 2)
    packed = sink_attention_ref(q[0], k[0], v[0], sinks, cu_seqlens=cu_seqlens, window=5)
    start = 0
    for length in lengths:
        piece = slice(start, start + length)
        alone = sink_attention_ref(q[:, piece], k[:, piece], v[:, piece], sinks, window=5)[0]
        assert torch.allclose(packed[piece], alone, atol=1e-12, rtol=0)
        start += length
