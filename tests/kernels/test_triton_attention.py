"""Triton sink-attention kernels (CPU interpreter) vs the float64 reference: o, lse, dq, dk, dv, dsinks."""

import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before that import

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gptoss_kernels import sink_attention, sink_attention_ref  # noqa: E402
from gptoss_kernels.triton import launchers, sink_attention_triton  # noqa: E402
from gptoss_kernels.triton.common import _cast  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CPU_OK = launchers.INTERPRETED or torch.cuda.is_available()
needs_kernel_device = pytest.mark.skipif(
    not CPU_OK, reason="no CUDA, and gptoss_kernels.triton was imported before TRITON_INTERPRET=1 was set"
)
NAMES = ("o", "dq", "dk", "dv", "dsinks")


@dataclass(frozen=True)
class Case:
    """One packed problem: document lengths, heads, head_dim, window, kernel tiles, scale, sink range."""

    lens: tuple
    hq: int
    hkv: int
    d: int = 16
    window: int | None = None
    blocks: tuple = (16, 16)
    scale: float | None = None
    sink_low: float = -1.0
    sink_high: float = 3.0


CASES = {
    "T37-full-gqa2-d64": Case((37,), 4, 2, d=64),
    "T113-win8-gqa4-m32n16": Case((113,), 4, 1, window=8, blocks=(32, 16)),
    "T50-win7-gqa1-m16n32": Case((50,), 2, 2, d=32, window=7, blocks=(16, 32)),
    "T100-win40-masked-and-full-tiles": Case((100,), 4, 2, window=40),
    "T90-win37-gqa2-m32n16-two-docs": Case((90, 31), 4, 2, window=37, blocks=(32, 16)),
    "window-gt-T-two-docs": Case((20, 13), 2, 2, window=64),
    "window-between-doc-lengths": Case((9, 40), 2, 1, window=16),
    "window1-gqa2": Case((29,), 4, 2, window=1),
    "varlen-0-1-full": Case((0, 1, 37, 0, 18), 4, 2, blocks=(16, 32)),
    "varlen-0-1-win5-gqa8": Case((1, 0, 50, 7), 8, 1, window=5),
    "scale0.3-win16": Case((45,), 2, 1, window=16, scale=0.3),
    "sink30-only-sink-matters": Case((3, 21), 2, 1, window=4, sink_low=30.0, sink_high=30.0),
    "sink-minus-inf-is-plain-attention": Case(
        (1, 26), 2, 1, window=6, blocks=(16, 32), sink_low=float("-inf"), sink_high=float("-inf")
    ),
    # head_dim that is not a power of two: tiles of the next power of two, zero-padded inside the kernels
    "d24-T45-win11-gqa2": Case((45,), 4, 2, d=24, window=11),
    "d80-varlen-full-gqa4": Case((19, 0, 33), 4, 1, d=80, blocks=(16, 32)),
    "d8-below-16-T30-win5": Case((30,), 2, 2, d=8, window=5),
}
LOWP_CASES = {
    "bf16-T37-full-gqa2-d64": (Case((37,), 4, 2, d=64), torch.bfloat16),
    "bf16-varlen-0-1-win5-gqa4": (Case((1, 0, 45, 6), 4, 1, window=5), torch.bfloat16),
    "fp16-T40-win9-gqa2": (Case((40,), 4, 2, window=9, blocks=(32, 16)), torch.float16),
}


@pytest.fixture(autouse=True)
def _nan_filled_outputs(monkeypatch):
    monkeypatch.setattr(launchers, "FILL_OUTPUTS_WITH_NAN", True)


def _cu_seqlens(lens, device="cpu"):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _inputs(case, dtype=torch.float64):
    """q, k, v, sinks, dO in ``dtype``, values in float64 first so every dtype sees the same data."""
    total = sum(case.lens)
    q = torch.randn(total, case.hq, case.d, dtype=torch.float64)
    k = torch.randn(total, case.hkv, case.d, dtype=torch.float64)
    v = torch.randn(total, case.hkv, case.d, dtype=torch.float64)
    sinks = torch.rand(case.hq, dtype=torch.float64)
    if case.sink_low == case.sink_high:  # a constant (possibly -inf) sink for every head
        sinks.fill_(case.sink_low)
    else:
        sinks = case.sink_low + (case.sink_high - case.sink_low) * sinks
    do = torch.randn(total, case.hq, case.d, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v)] + [sinks, do.to(dtype)]


def _grads(fn, q, k, v, sinks, do):
    """Run ``fn`` on fresh leaves; return ``[o, dq, dk, dv, dsinks]``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    o = fn(*leaves)
    return [o.detach(), *torch.autograd.grad(o, leaves, do)]


def _reference64(case, q, k, v, sinks, do):
    cu = _cu_seqlens(case.lens, q.device)
    fn = lambda q, k, v, s: sink_attention_ref(q, k, v, s, cu_seqlens=cu, window=case.window, scale=case.scale)
    return _grads(fn, *(t.double() for t in (q, k, v, sinks, do)))


def _triton(case, q, k, v, sinks, do):
    cu = _cu_seqlens(case.lens, q.device)
    fn = lambda q, k, v, s: sink_attention_triton(
        q,
        k,
        v,
        s,
        cu_seqlens=cu,
        max_seqlen=max(case.lens),
        window=case.window,
        scale=case.scale,
        block_sizes=case.blocks,
    )
    return _grads(fn, q, k, v, sinks, do)


def _fa4(case, q, k, v, sinks, do):
    """FA4's learnable_sink through the public dispatcher (``backend="fa4"``), same contract as ``_triton``."""
    cu = _cu_seqlens(case.lens, q.device)
    fn = lambda q, k, v, s: sink_attention(
        q, k, v, s, cu_seqlens=cu, max_seqlen=max(case.lens), window=case.window, scale=case.scale, backend="fa4"
    )
    return _grads(fn, q, k, v, sinks, do)


def _torch_lowp(case, q, k, v, sinks, do):
    """The same math as transformers' GPT-OSS eager, every op in the low dtype (the tolerance yardstick)."""
    scale = case.d**-0.5 if case.scale is None else case.scale

    def attend(q, k, v, s):
        pieces, bounds = [], _cu_seqlens(case.lens).tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            qd, kd, vd = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, T, D]
            group = case.hq // case.hkv
            kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
            scores = qd @ kd.transpose(1, 2) * scale
            pos = torch.arange(end - start, device=q.device)
            allowed = pos[None, :] <= pos[:, None]
            if case.window is not None:
                allowed &= pos[None, :] > pos[:, None] - case.window
            scores = scores.masked_fill(~allowed, float("-inf"))
            logits = torch.cat([scores, s.to(q.dtype)[:, None, None].expand(-1, end - start, 1)], dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = torch.softmax(logits, dim=-1, dtype=q.dtype)[..., :-1]
            pieces.append((probs @ vd).transpose(0, 1))
        return torch.cat(pieces)

    return _grads(attend, q, k, v, sinks.to(q.dtype), do)


def _assert_close(name, actual, ref, tol):
    err = (actual.double() - ref).abs()
    assert not torch.isnan(actual).any(), f"{name}: NaN (an output element the kernel never wrote?)"
    assert err.max() <= tol, (
        f"{name}: max|diff| {err.max():.3e} (mean {err.mean():.3e}) > tol {tol:.3e}; max|ref| {ref.abs().max():.3e}"
    )


@needs_kernel_device
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fp32_matches_float64_reference(case):
    q, k, v, sinks, do = _inputs(case, torch.float32)
    sinks = sinks.float()
    ref = _reference64(case, q, k, v, sinks, do)
    got = _triton(case, q, k, v, sinks, do)
    assert got[4].dtype == torch.float32
    for name, actual, expected in zip(NAMES, got, ref):
        # Relative to the tensor's own scale, so the sink=30 case (values ~1e-11) is checked, not waved through.
        _assert_close(name, actual, expected, 1e-5 * expected.abs().max().item() + 1e-30)


@needs_kernel_device
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_lse_includes_the_sink(case):
    q, k, v, sinks, _ = _inputs(case, torch.float32)
    sinks = sinks.float()
    cu = _cu_seqlens(case.lens)
    scale = case.d**-0.5 if case.scale is None else case.scale
    o, lse = launchers.sink_attention_fwd(q, k, v, sinks, cu, max(case.lens), case.window, scale, case.blocks)
    o_ref, lse_ref = sink_attention_ref(
        q.double(),
        k.double(),
        v.double(),
        sinks.double(),
        cu_seqlens=cu,
        window=case.window,
        scale=case.scale,
        return_lse=True,
    )
    _assert_close("lse", lse, lse_ref, 1e-5 * max(lse_ref.abs().max().item(), 1.0))
    _assert_close("o (launcher)", o, o_ref, 1e-5 * max(o_ref.abs().max().item(), 1.0))
    if case.sink_low >= 30:  # every key is negligible next to exp(30): lse = sink, o ~ 0
        assert (lse - sinks).abs().max() < 1e-5 and o.abs().max() < 1e-9


def _dsinks_from_output(case, q, k, v, sinks, do, o):
    """``-sum_i exp(sink - lse_i) * rowsum(dO_i * o_i)`` with the float64 lse and a given output ``o``.

    Every FlashAttention backward forms ``D = rowsum(dO * O)`` from the forward output as stored, so dsinks
    inherits the forward's error in O. Fed with the low-precision PyTorch output, this is the kernel's own
    dsinks formula run in PyTorch: the yardstick for dsinks (O's own error is checked separately).
    """
    _, lse = sink_attention_ref(
        *(t.double() for t in (q, k, v, sinks)),
        cu_seqlens=_cu_seqlens(case.lens, q.device),
        window=case.window,
        scale=case.scale,
        return_lse=True,
    )
    delta = (do.double() * o.double()).sum(-1)
    return -(torch.exp(sinks.double() - lse) * delta).sum(0)


@needs_kernel_device
@pytest.mark.parametrize(("case", "dtype"), LOWP_CASES.values(), ids=LOWP_CASES.keys())
def test_low_precision_within_twice_torch_error(case, dtype):
    _check_low_precision(case, dtype, "cpu")


def _check_low_precision(case, dtype, device, run=_triton):
    """``|kernel - ref64| <= 2 |torch_lowp - ref64| + atol`` for o and every gradient (also the GPU tests)."""
    q, k, v, sinks, do = (t.to(device) for t in _inputs(case, dtype))
    sinks = sinks.float()
    ref = _reference64(case, q, k, v, sinks, do)  # float64 math on the same rounded inputs
    lowp = _torch_lowp(case, q, k, v, sinks, do)
    got = run(case, q, k, v, sinks, do)
    assert [t.dtype for t in got] == [dtype] * 4 + [torch.float32]
    lowp_err = [(t.double() - r).abs().max().item() for t, r in zip(lowp, ref)]
    dsinks_formula = _dsinks_from_output(case, q, k, v, sinks, do, lowp[0])
    lowp_err[4] = max(lowp_err[4], (dsinks_formula - ref[4]).abs().max().item())
    for name, actual, err, expected in zip(NAMES, got, lowp_err, ref):
        atol = 1e-3 * max(expected.abs().max().item(), 1.0)
        _assert_close(name, actual, expected, 2 * err + atol)


@needs_kernel_device
def test_dsinks_come_back_in_the_sinks_dtype():
    case = Case((9, 0, 16), 2, 1, window=3)
    q, k, v, sinks, do = _inputs(case, torch.float32)
    got = _triton(case, q, k, v, sinks.to(torch.bfloat16), do)
    ref = _reference64(case, q, k, v, sinks.to(torch.bfloat16), do)
    assert got[4].dtype == torch.bfloat16
    _assert_close("dsinks (bf16 sinks)", got[4], ref[4], 1e-2 * ref[4].abs().max().item())


@needs_kernel_device
def test_non_contiguous_inputs_and_grad_output():
    """transformers hands attention ``[B, H, T, D]`` tensors transposed to ``[B, T, H, D]`` views."""
    case = Case((17, 30), 4, 2, window=9)
    q, k, v, sinks, do = _inputs(case, torch.float32)
    views = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v, do)]
    assert not any(t.is_contiguous() for t in views)
    got = _triton(case, *views[:3], sinks.float(), views[3])
    ref = _reference64(case, q, k, v, sinks, do)
    for name, actual, expected in zip(NAMES, got, ref):
        _assert_close(name, actual, expected, 1e-5 * max(expected.abs().max().item(), 1.0))


@triton.jit
def _cast_to_bf16_kernel(X, Y, BF16_RTNE: tl.constexpr):
    offs = tl.arange(0, 1024)
    tl.store(Y + offs, _cast(tl.load(X + offs), tl.bfloat16, BF16_RTNE))


@needs_kernel_device
def test_bf16_cast_rounds_to_nearest_even_like_the_gpu():
    """P, dS and the outputs are rounded to bf16 in-kernel; the interpreter must round as the GPU does."""
    x = torch.randn(1024) * torch.logspace(-6, 6, 1024)
    y = torch.full((1024,), float("nan"), dtype=torch.bfloat16, device=x.device)
    _cast_to_bf16_kernel[(1,)](x, y, BF16_RTNE=launchers.INTERPRETED)
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def _valid_args(**overrides):
    args = dict(
        q=torch.randn(10, 4, 16),
        k=torch.randn(10, 2, 16),
        v=torch.randn(10, 2, 16),
        sinks=torch.zeros(4),
        cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32),
        max_seqlen=6,
    )
    args.update(overrides)
    return args


BAD_INPUTS = {
    "float64": (
        dict(
            q=torch.randn(10, 4, 16, dtype=torch.float64),
            k=torch.randn(10, 2, 16, dtype=torch.float64),
            v=torch.randn(10, 2, 16, dtype=torch.float64),
        ),
        "takes fp16/bf16/fp32",
    ),
    "head-dim-256": (
        dict(q=torch.randn(10, 4, 256), k=torch.randn(10, 2, 256), v=torch.randn(10, 2, 256)),
        "head_dim <= 128",
    ),
    "cu-seqlens-k-shorter-than-queries": (
        dict(cu_seqlens_k=torch.tensor([0, 3, 10], dtype=torch.int32), max_seqlen_k=7),
        "at least as many keys as queries",
    ),
    "cu-seqlens-k-other-doc-count": (
        dict(cu_seqlens_k=torch.tensor([0, 10], dtype=torch.int32), max_seqlen_k=10),
        "same number of documents",
    ),
    "batched-layout": (dict(q=torch.randn(1, 10, 4, 16), cu_seqlens=None), "cu_seqlens"),
    "max-seqlen-too-small": (dict(max_seqlen=5), "max_seqlen"),
    "max-seqlen-float": (dict(max_seqlen=6.0), "max_seqlen"),
    "cu-seqlens-int64": (dict(cu_seqlens=torch.tensor([0, 4, 10])), "int32"),
    "cu-seqlens-decreasing": (dict(cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32)), "non-decreasing"),
    "sinks-wrong-length": (dict(sinks=torch.zeros(2)), "one logit per query head"),
    "sinks-none": (dict(sinks=None), "sinks"),
    "gqa-3-over-2": (dict(q=torch.randn(10, 3, 16)), "multiple"),
    "window-0": (dict(window=0), "window"),
    "scale-negative": (dict(scale=-1.0), "scale"),
    "block-8": (dict(block_sizes=(8, 16)), "BLOCK_M"),
    "block-24": (dict(block_sizes=(16, 24)), "BLOCK_N"),
    "block-sizes-not-a-pair": (dict(block_sizes=32), "pair"),
}


@pytest.mark.parametrize(("overrides", "message"), BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_value_error(overrides, message):
    args = _valid_args(**overrides)
    with pytest.raises(ValueError, match=message):
        sink_attention_triton(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("sinks"), **args)


def test_cpu_tensors_without_the_interpreter_raise_value_error():
    """Compiled (non-interpreted) kernels cannot take CPU tensors: say so instead of crashing in the driver."""
    code = (
        "import torch; from gptoss_kernels.triton import sink_attention_triton as f; "
        "cu = torch.tensor([0, 8], dtype=torch.int32); q = torch.randn(8, 2, 16)\n"
        "try:\n    f(q, q, q, torch.zeros(2), cu_seqlens=cu, max_seqlen=8)\n"
        "except ValueError as err:\n    print(err)"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "tensors are not on CUDA" in run.stdout, run.stdout + run.stderr[-2000:]


AOT_TARGETS = {
    "sm90-bf16-window128": ["--arch", "90", "--dtype", "bf16", "--window", "128"],
    "sm80-fp16-full": ["--arch", "80", "--dtype", "fp16"],
    "sm90-bf16-d80-padded": ["--arch", "90", "--dtype", "bf16", "--head-dim", "80"],
}


@pytest.mark.slow
@pytest.mark.parametrize("args", AOT_TARGETS.values(), ids=AOT_TARGETS.keys())
def test_kernels_compile_to_cubin_for_cuda(args, tmp_path):
    """The interpreter accepts code the compiler rejects; lower all four kernels to a cubin (no GPU needed)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run(
        [sys.executable, "-m", "gptoss_kernels.triton.aot", *args], env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(records) == 4 and all(r["has_cubin"] for r in records), records
    assert max(r["shared_bytes"] for r in records) <= 99 * 1024  # fits every sm80+ GPU, consumer ones too


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128], ids=["full", "window128"])
def test_gpt_oss_shape_bf16_on_gpu(window):
    """64 q heads / 8 kv heads, d 64, two documents totalling 4096 tokens, bf16, default CUDA block sizes."""
    _check_low_precision(Case((3000, 1096), 64, 8, d=64, window=window, blocks=None), torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128], ids=["full", "window128"])
def test_fa4_gpt_oss_shape_bf16_on_gpu(window):
    """FA4's learnable_sink through the dispatcher: the Triton GPU test's case, yardstick and gradients."""
    from gptoss_kernels.fa4 import fa4_available

    if not fa4_available():
        pytest.skip("flash-attn-4 on SM90+ is not available")
    case = Case((3000, 1096), 64, 8, d=64, window=window, blocks=None)
    _check_low_precision(case, torch.bfloat16, "cuda", run=_fa4)


def test_every_kernel_is_launched_by_keyword():
    """``kernel[grid](Q=q, stride_qt=..., ...)``: no positional argument can shift when a kernel's parameters
    change (STYLE.md 13)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(launchers))
    launches = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)]
    assert len(launches) == 4, "forward, preprocess, dQ and dK/dV launches"
    for call in launches:
        assert not call.args, f"positional arguments in the launch at line {call.lineno}"
