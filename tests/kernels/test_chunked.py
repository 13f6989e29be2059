"""Chunked CPU sink attention vs the float64 reference: o, dq, dk, dv and dsinks at hostile shapes."""

from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

import gptoss_kernels
from gptoss_kernels import chunked, sink_attention_chunked, sink_attention_ref

F64 = torch.float64
NAMES = ("o", "dq", "dk", "dv", "dsinks")


@dataclass(frozen=True)
class Case:
    batch: int = 1
    tq: int = 0
    tk: int = 0
    lengths: tuple = ()  # packed documents when non-empty
    hq: int = 4
    hkv: int = 2
    window: int | None = None
    sink: float | None = None  # every sink set to this value; None = random in [-1, 3)
    q_chunk: int = 16
    key_chunk: int | None = 24
    dim: int = 32
    holes: str = ""  # batched key-validity mask: "" none, else a pattern name of _key_mask


CASES = {
    "b2-t113-h4kv2-full": Case(batch=2, tq=113, tk=113),
    "b2-t113-h4kv2-w17": Case(batch=2, tq=113, tk=113, window=17),
    "b1-t203-h8kv1-w1": Case(tq=203, tk=203, hq=8, hkv=1, window=1),
    "b2-t50-h2kv2-w64>T": Case(batch=2, tq=50, tk=50, hq=2, hkv=2, window=64),
    "varlen-1,0,37,64,5-h4kv2-w9": Case(lengths=(1, 0, 37, 64, 5), window=9),
    "varlen-1,0,37,64,5-h4kv4-full": Case(lengths=(1, 0, 37, 64, 5), hkv=4),
    "decode-b2-tq5-tk40-h4kv2-w7": Case(batch=2, tq=5, tk=40, window=7),
    "decode-b3-tq1-tk33-h8kv1-full": Case(batch=3, tq=1, tk=33, hq=8, hkv=1),
    "only-sink-s30-b1-t40-w3": Case(tq=40, tk=40, window=3, sink=30.0),
    "no-sink-b2-t45-full": Case(batch=2, tq=45, tk=45, sink=float("-inf")),
    "default-chunks-b1-t300-w100": Case(tq=300, tk=300, window=100, q_chunk=chunked.DEFAULT_Q_CHUNK, key_chunk=None),
    "holes-b3-t70-h4kv2-full": Case(batch=3, tq=70, tk=70, holes="mixed"),
    "holes-b3-t70-h8kv2-w11": Case(batch=3, tq=70, tk=70, hq=8, window=11, holes="mixed"),
    "holes-decode-b3-tq6-tk50-w9": Case(batch=3, tq=6, tk=50, window=9, holes="mixed"),
    "holes-no-sink-b3-t40-w5": Case(batch=3, tq=40, tk=40, window=5, sink=float("-inf"), holes="mixed"),
}
LOWP_CASES = [
    "b2-t113-h4kv2-full",
    "b1-t203-h8kv1-w1",
    "varlen-1,0,37,64,5-h4kv2-w9",
    "decode-b2-tq5-tk40-h4kv2-w7",
    "holes-b3-t70-h8kv2-w11",
]


def _key_mask(case):
    """Row 0: holes every 3rd key and a padded tail; row 1: left padding; row 2: no valid key at all (its
    queries see only the sink, or nothing under a -inf sink)."""
    if not case.holes:
        return None
    mask = torch.ones(case.batch, case.tk, dtype=torch.bool)
    mask[0, ::3] = False
    mask[0, -5:] = False
    mask[1, : case.tk // 2] = False
    mask[2] = False
    return mask


@pytest.fixture(autouse=True)
def _nan_outputs(monkeypatch):
    """Unwritten output rows must show up as NaN, not as whatever memory held."""

    def nan_buffer(*shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(chunked, "_new_output", nan_buffer)


def _make_inputs(case):
    """float64 leaves (q, k, v, sinks), cu_seqlens or None, and a float64 upstream gradient."""
    if case.lengths:
        total = sum(case.lengths)
        q_shape, k_shape = (total, case.hq, case.dim), (total, case.hkv, case.dim)
        bounds = torch.tensor([0, *case.lengths]).cumsum(0)
        cu_seqlens = bounds.to(torch.int32)
    else:
        q_shape, k_shape = (case.batch, case.tq, case.hq, case.dim), (case.batch, case.tk, case.hkv, case.dim)
        cu_seqlens = None
    q, k, v = torch.randn(q_shape, dtype=F64), torch.randn(k_shape, dtype=F64), torch.randn(k_shape, dtype=F64)
    if case.sink is None:
        sinks = torch.rand(case.hq, dtype=F64) * 4 - 1
    else:
        sinks = torch.full((case.hq,), case.sink, dtype=F64)
    return (q, k, v, sinks), cu_seqlens, torch.randn(q_shape, dtype=F64)


def _kwargs(case, cu_seqlens):
    return dict(cu_seqlens=cu_seqlens, window=case.window, key_mask=_key_mask(case))


def _run(fn, leaves, grad_out, dtype, **kwargs):
    """Output and gradients of fn on leaves cast to dtype (sinks stay float32/float64, as model params)."""
    sink_dtype = F64 if dtype == F64 else torch.float32
    inputs = [t.to(dtype).requires_grad_() for t in leaves[:3]] + [leaves[3].to(sink_dtype).requires_grad_()]
    out = fn(*inputs, **kwargs)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    return [out.to(F64), *(g.to(F64) for g in grads)]


def _eager_lowp(q, k, v, sinks, cu_seqlens=None, window=None, key_mask=None):
    """The same math in the input dtype: transformers' GPT-OSS eager, per document when packed."""
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        pieces = [
            _eager_lowp(q[None, a:b], k[None, a:b], v[None, a:b], sinks, window=window)[0]
            for a, b in zip(bounds[:-1], bounds[1:])
            if b > a
        ]
        return torch.cat(pieces)
    tq, tk = q.shape[1], k.shape[1]
    q_pos, k_pos = torch.arange(tk - tq, tk)[:, None], torch.arange(tk)[None, :]
    allowed = (k_pos <= q_pos) & (k_pos > q_pos - window if window else True)
    allowed = allowed[None] if key_mask is None else allowed[None] & key_mask[:, None, :]
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    module = type("M", (), dict(sinks=sinks.to(q.dtype), num_key_value_groups=q.shape[2] // k.shape[2], training=False))
    out, _ = eager_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None], scaling=q.shape[-1] ** -0.5
    )
    return out


def _report(name, got, ref):
    diff = (got - ref).abs()
    return (
        f"{name}: max|diff|={diff.max().item():.3e} mean|diff|={diff.mean().item():.3e} "
        f"max|ref|={ref.abs().max().item():.3e}"
    )


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_chunked_fp32_matches_float64_reference(case):
    leaves, cu_seqlens, grad_out = _make_inputs(case)
    kwargs = _kwargs(case, cu_seqlens)
    ref = _run(sink_attention_ref, leaves, grad_out, F64, **kwargs)
    got = _run(
        sink_attention_chunked,
        leaves,
        grad_out,
        torch.float32,
        q_chunk=case.q_chunk,
        key_chunk=case.key_chunk,
        **kwargs,
    )
    for name, g, r in zip(NAMES, got, ref):
        assert torch.isfinite(g).all(), f"{name} has non-finite entries"
        tol = 1e-5 * max(r.abs().max().item(), 1.0)
        assert (g - r).abs().max().item() <= tol, _report(name, g, r)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_chunked_float64_is_exact(case):
    leaves, cu_seqlens, grad_out = _make_inputs(case)
    kwargs = _kwargs(case, cu_seqlens)
    ref = _run(sink_attention_ref, leaves, grad_out, F64, **kwargs)
    got = _run(sink_attention_chunked, leaves, grad_out, F64, q_chunk=case.q_chunk, key_chunk=case.key_chunk, **kwargs)
    for name, g, r in zip(NAMES, got, ref):
        assert (g - r).abs().max().item() <= 1e-10 * max(r.abs().max().item(), 1.0), _report(name, g, r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case_id", LOWP_CASES)
def test_chunked_low_precision_within_twice_torch_error(case_id, dtype):
    """|chunked - ref64| <= 2 |eager run in dtype - ref64| + atol, for o and every gradient."""
    case = CASES[case_id]
    leaves, cu_seqlens, grad_out = _make_inputs(case)
    leaves = [t.to(dtype).to(F64) for t in leaves]  # the low-precision inputs are the ground truth's inputs
    kwargs = _kwargs(case, cu_seqlens)
    ref = _run(sink_attention_ref, leaves, grad_out, F64, **kwargs)
    torch_lowp = _run(_eager_lowp, leaves, grad_out, dtype, **kwargs)
    got = _run(
        sink_attention_chunked, leaves, grad_out, dtype, q_chunk=case.q_chunk, key_chunk=case.key_chunk, **kwargs
    )
    for name, g, t, r in zip(NAMES, got, torch_lowp, ref):
        bound = 2 * (t - r).abs().max().item() + 1e-3 * max(r.abs().max().item(), 1.0)
        assert (g - r).abs().max().item() <= bound, f"{_report(name, g, r)}; torch {dtype} {_report(name, t, r)}"


def test_lse_includes_the_sink_and_matches_reference():
    case = CASES["varlen-1,0,37,64,5-h4kv2-w9"]
    (q, k, v, sinks), cu_seqlens, _ = _make_inputs(case)
    _, lse = sink_attention_chunked(
        q, k, v, sinks, cu_seqlens=cu_seqlens, window=9, return_lse=True, q_chunk=16, key_chunk=24
    )
    _, lse_ref = sink_attention_ref(q, k, v, sinks, cu_seqlens=cu_seqlens, window=9, return_lse=True)
    assert (lse - lse_ref).abs().max().item() <= 1e-12
    assert (lse >= sinks).all(), "lse must be at least the sink logit"


def test_sinks_without_grad_and_empty_input():
    q = torch.randn(0, 4, 8)
    kv = torch.randn(0, 2, 8)
    out = sink_attention_chunked(q, kv, kv, torch.zeros(4), cu_seqlens=torch.zeros(2, dtype=torch.int32))
    assert out.shape == (0, 4, 8)
    q = torch.randn(1, 9, 4, 8, requires_grad=True)
    kv = torch.randn(1, 9, 2, 8)
    sink_attention_chunked(q, kv, kv, torch.zeros(4)).sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(q_chunk=0), "q_chunk"),
        (dict(key_chunk=-3), "key_chunk"),
        (dict(scale=-1.0), "scale"),
        (dict(scale="0.1"), "scale"),
    ],
)
def test_chunked_rejects_bad_tuning_arguments(kwargs, match):
    q, kv = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=match):
        sink_attention_chunked(q, kv, kv, torch.zeros(2), **kwargs)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces (views included, so it over- rather than under-counts)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.numel = max([self.numel, *sizes])
        return out


def test_no_tensor_grows_with_t_squared():
    """Forward + backward at T=1024 never creates anything larger than q or one score tile (O(T * chunk))."""
    seqlen, hq, hkv, dim, q_chunk, key_chunk = 1024, 4, 2, 16, 64, 128
    leaves = [
        torch.randn(1, seqlen, hq, dim),
        torch.randn(1, seqlen, hkv, dim),
        torch.randn(1, seqlen, hkv, dim),
        torch.randn(hq),
    ]
    leaves = [t.requires_grad_() for t in leaves]
    with _LargestTensor() as largest:
        out = sink_attention_chunked(*leaves, q_chunk=q_chunk, key_chunk=key_chunk)
        out.sum().backward()
    bound = max(seqlen * hq * dim, hq * q_chunk * key_chunk)
    assert largest.numel <= bound < hq * seqlen * seqlen // 16, f"largest tensor {largest.numel} > {bound}"


def test_intervals_entry_equals_reference_rows():
    """Arbitrary query rows over key intervals (the padding rows of a right-padded batch), empty ones too."""
    q, k, v = torch.randn(5, 4, 16, dtype=F64), torch.randn(12, 2, 16, dtype=F64), torch.randn(12, 2, 16, dtype=F64)
    sinks = torch.randn(4, dtype=F64)
    lo, hi = [0, 2, 2, 9, 11], [3, 3, 7, 8, 11]  # row 3 is empty (lo > hi)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    intervals = gptoss_kernels.row_intervals(lo, hi, "cpu")
    got = gptoss_kernels.sink_attention_intervals(*leaves, intervals, q_chunk=2, key_chunk=3)
    want = []
    for r in range(5):
        keys = torch.arange(12)
        mask = ((keys >= lo[r]) & (keys <= hi[r]))[None]
        want.append(
            sink_attention_ref(
                leaves[0][r][None, None],
                leaves[1][None],
                leaves[2][None],
                leaves[3],
                key_mask=mask.expand(1, 12) & torch.ones(1, 12, dtype=torch.bool),
            )[0, 0]
        )
    want = torch.stack(want)
    # the reference's queries sit at the last key position; every key is before it, so only lo/hi limit them
    grad_out = torch.randn_like(want)
    for name, g, w in zip(
        NAMES, (got, *torch.autograd.grad(got, leaves, grad_out)), (want, *torch.autograd.grad(want, leaves, grad_out))
    ):
        assert (g - w).abs().max().item() <= 1e-12, _report(name, g, w)
    assert (got[3] == 0).all()
    with pytest.raises(ValueError, match="non-decreasing"):
        gptoss_kernels.row_intervals([3, 2, 2, 9, 11], hi, "cpu")
    with pytest.raises(ValueError, match="end before key 12"):
        beyond = gptoss_kernels.row_intervals(lo, [3, 3, 7, 8, 12], "cpu")
        gptoss_kernels.sink_attention_intervals(q, k, v, sinks, beyond)


def test_key_mask_path_stays_memory_bounded():
    """A key-validity mask adds a [C, key_chunk] tile mask, never a [T, T] one."""
    seqlen, hq, hkv, dim, q_chunk, key_chunk = 1024, 4, 2, 16, 64, 128
    leaves = [
        torch.randn(2, seqlen, hq, dim),
        torch.randn(2, seqlen, hkv, dim),
        torch.randn(2, seqlen, hkv, dim),
        torch.randn(hq),
    ]
    leaves = [t.requires_grad_() for t in leaves]
    key_mask = torch.rand(2, seqlen) > 0.3
    with _LargestTensor() as largest:
        out = sink_attention_chunked(*leaves, key_mask=key_mask, q_chunk=q_chunk, key_chunk=key_chunk)
        out.sum().backward()
    bound = max(2 * seqlen * hq * dim, hq * q_chunk * key_chunk)
    assert largest.numel <= bound < hq * seqlen * seqlen // 16, f"largest tensor {largest.numel} > {bound}"
