"""Public ``sink_attention``: backend choice (logged once), forced backends, and bad input."""

import logging
import os
import re

import pytest
import torch

import gptoss_kernels
from gptoss_kernels import attention, select_backend, sink_attention, sink_attention_ref


def _qkv(batch=1, tq=6, tk=6, hq=4, hkv=2, dim=8, dtype=torch.float32):
    return (
        torch.randn(batch, tq, hq, dim, dtype=dtype),
        torch.randn(batch, tk, hkv, dim, dtype=dtype),
        torch.randn(batch, tk, hkv, dim, dtype=dtype),
        torch.randn(hq),
    )


def test_auto_on_cpu_is_chunked_and_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(attention, "_LOGGED", set())
    q, k, v, sinks = _qkv()
    with caplog.at_level(logging.INFO, logger="gptoss_kernels"):
        sink_attention(q, k, v, sinks)
        sink_attention(q, k, v, sinks)
    messages = [r.getMessage() for r in caplog.records if r.name == "gptoss_kernels"]
    assert len(messages) == 1 and "chunked" in messages[0], messages
    assert select_backend(q, k, None, None)[0] == "chunked"


@pytest.mark.parametrize("backend", ["chunked", "reference", "auto"])
def test_backends_agree_on_decode_layout(backend):
    q, k, v, sinks = _qkv(batch=2, tq=3, tk=11)
    got = sink_attention(q, k, v, sinks, window=4, backend=backend)
    want = sink_attention_ref(q.double(), k.double(), v.double(), sinks.double(), window=4)
    assert (got.double() - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "backend, match",
    [
        ("flash", "backend must be one of"),
        ("triton", "not on CUDA"),
        ("fa4", "flash-attn-4"),
    ],
)
def test_unavailable_or_unknown_backend_raises(backend, match, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, sinks = _qkv()
    with pytest.raises(ValueError, match=match):
        sink_attention(q, k, v, sinks, backend=backend)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 before import")
@pytest.mark.parametrize("packed", [False, True], ids=["batched-flattened", "varlen"])
def test_forced_triton_backend_under_the_interpreter(packed):
    """The dispatch glue (batched -> packed flattening, max_seqlen) around the colleague's Triton kernel."""
    pytest.importorskip("triton")
    q, k, v, sinks = _qkv(batch=2, tq=37, tk=37, dim=16)
    kwargs = dict(window=5)
    if packed:
        q, k, v = (t.reshape(74, t.shape[2], 16) for t in (q, k, v))
        kwargs["cu_seqlens"] = torch.tensor([0, 1, 1, 30, 74], dtype=torch.int32)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    out = sink_attention(*leaves, backend="triton", **kwargs)
    got = [out, *torch.autograd.grad(out.sum(), leaves)]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = sink_attention_ref(*leaves64, **kwargs)
    want = [ref, *torch.autograd.grad(ref.sum(), leaves64)]
    for name, g, w in zip(("o", "dq", "dk", "dv", "dsinks"), got, want):
        diff = (g.double() - w).abs().max().item()
        assert diff <= 1e-5 * max(w.abs().max().item(), 1.0), f"{name}: max|diff|={diff:.3e}"


def _bad(**changes):
    q, k, v, sinks = _qkv()
    args = dict(q=q, k=k, v=v, sinks=sinks, cu_seqlens=None, window=None)
    args.update(changes)
    return args


BAD_INPUTS = {
    "q-rank-3-without-cu_seqlens": (_bad(q=torch.randn(6, 4, 8)), "4-D"),
    "k-rank-5": (_bad(k=torch.randn(1, 6, 2, 8, 1)), "4-D"),
    "int-dtype": (_bad(q=torch.ones(1, 6, 4, 8, dtype=torch.int64)), "dtype"),
    "mixed-dtype": (_bad(k=torch.randn(1, 6, 2, 8, dtype=torch.float64)), "share a dtype"),
    "k-on-meta-device": (_bad(k=torch.empty(1, 6, 2, 8, device="meta")), "device"),
    "head-dim-mismatch": (_bad(k=torch.randn(1, 6, 2, 4), v=torch.randn(1, 6, 2, 4)), "head_dim"),
    "hq-not-multiple-of-hkv": (_bad(k=torch.randn(1, 6, 3, 8), v=torch.randn(1, 6, 3, 8)), "multiple"),
    "k-shorter-than-q": (_bad(k=torch.randn(1, 5, 2, 8), v=torch.randn(1, 5, 2, 8)), "at least q's length"),
    "sinks-wrong-length": (_bad(sinks=torch.zeros(3)), r"shape \(4,\)"),
    "sinks-none": (_bad(sinks=None), "sinks is None"),
    "window-zero": (_bad(window=0), "window"),
    "window-negative": (_bad(window=-2), "window"),
    "window-float": (_bad(window=2.0), "window"),
    "window-overflows-int32": (_bad(window=2**31), "window=2147483648 does not fit int32"),
    "sinks-int64": (_bad(sinks=torch.zeros(4, dtype=torch.int64)), "sinks has dtype torch.int64"),
    "sinks-bool": (_bad(sinks=torch.zeros(4, dtype=torch.bool)), "sinks has dtype torch.bool"),
    "head-dim-0": (
        _bad(q=torch.randn(1, 6, 4, 0), k=torch.randn(1, 6, 2, 0), v=torch.randn(1, 6, 2, 0)),
        "head_dim is 0",
    ),
    "key-mask-not-bool": (_bad(key_mask=torch.ones(1, 6)), "key_mask must be a bool"),
    "scale-negative": (_bad(scale=-0.5), "scale must be a positive"),
    "scale-nan": (_bad(scale=float("nan")), "scale must be a positive"),
    "key-mask-wrong-shape": (_bad(key_mask=torch.ones(1, 5, dtype=torch.bool)), r"key_mask must have shape"),
}


@pytest.mark.parametrize("args, match", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
@pytest.mark.parametrize("fn", [sink_attention, gptoss_kernels.sink_attention_chunked], ids=["public", "chunked"])
def test_bad_batched_input_raises_value_error(fn, args, match):
    args = dict(args)
    tensors = [args.pop(name) for name in ("q", "k", "v", "sinks")]
    with pytest.raises(ValueError, match=match):
        fn(*tensors, **args)


BAD_CU_SEQLENS = {
    "int64": (torch.tensor([0, 3, 6]), "int32"),
    "non-monotonic": (torch.tensor([0, 4, 2, 6], dtype=torch.int32), "non-decreasing"),
    "not-starting-at-0": (torch.tensor([1, 6], dtype=torch.int32), "start at 0"),
    "wrong-total": (torch.tensor([0, 3, 5], dtype=torch.int32), "packed token count"),
    "2-d": (torch.tensor([[0, 6]], dtype=torch.int32), "1-D"),
}


@pytest.mark.parametrize("cu_seqlens, match", BAD_CU_SEQLENS.values(), ids=BAD_CU_SEQLENS.keys())
@pytest.mark.parametrize(
    "fn",
    [sink_attention, gptoss_kernels.sink_attention_chunked, sink_attention_ref],
    ids=["public", "chunked", "reference"],
)
def test_bad_cu_seqlens_raises_value_error(fn, cu_seqlens, match):
    q, kv = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    with pytest.raises(ValueError, match=match):
        fn(q, kv, kv, torch.zeros(4), cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("max_seqlen", [2, 3.5, True, -1], ids=["shorter-than-longest", "float", "bool", "negative"])
@pytest.mark.parametrize(
    "fn",
    [sink_attention, gptoss_kernels.sink_attention_chunked, sink_attention_ref],
    ids=["public", "chunked", "reference"],
)
def test_max_seqlen_inconsistent_with_cu_seqlens_raises(fn, max_seqlen):
    q, kv = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    cu_seqlens = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen must be an int >= the longest document in cu_seqlens \(4\)"):
        fn(q, kv, kv, torch.zeros(4), cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


def test_key_mask_is_refused_for_the_packed_layout():
    q, kv = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    with pytest.raises(ValueError, match="key_mask is for the batched layout"):
        sink_attention(
            q,
            kv,
            kv,
            torch.zeros(4),
            cu_seqlens=torch.tensor([0, 6], dtype=torch.int32),
            key_mask=torch.ones(1, 6, dtype=torch.bool),
        )


def test_cu_seqlens_are_read_back_once_and_rechecked_after_a_write():
    """Validation remembers a cu_seqlens tensor (one host copy per layout, not per layer); an in-place
    write bumps its version and the next call validates again."""
    q, kv = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    cu_seqlens = torch.tensor([0, 2, 6], dtype=torch.int32)
    sink_attention(q, kv, kv, torch.zeros(4), cu_seqlens=cu_seqlens)
    cu_seqlens[1] = 7
    with pytest.raises(ValueError, match="non-decreasing"):
        sink_attention(q, kv, kv, torch.zeros(4), cu_seqlens=cu_seqlens)


@pytest.mark.gpu
def test_fa4_matches_reference_on_sm90():
    """Only meaningful on an SM90+ GPU with flash-attn-4 installed; skipped everywhere else."""
    from gptoss_kernels.fa4 import fa4_available

    if not fa4_available():
        pytest.skip("flash-attn-4 on SM90+ is not available")
    q, k, v, sinks = (t.cuda() for t in _qkv(batch=2, tq=300, tk=300, hq=8, hkv=2, dim=64))
    q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
    sinks.requires_grad_()
    out = sink_attention(q, k, v, sinks, window=128, backend="fa4")
    ref = sink_attention_ref(q.double(), k.double(), v.double(), sinks.double(), window=128)
    assert (out.double() - ref).abs().max().item() <= 2e-2
    out.sum().backward()
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()


# dtype, head_dim, layout, expected ``auto`` choice ("fa4|triton": FA4 when flash-attn-4 runs on this GPU). The FA4
# cases share their kernels' compile keys with the other FA4 GPU tests (bf16, window 128; packed GQA 8 as GPT-OSS,
# batched GQA 4 as test_fa4_matches_reference_on_sm90): each new key costs the GPU check kit a CuTe DSL compile.
GPU_DISPATCH_CASES = {
    "bf16-d64-packed-two-docs": (torch.bfloat16, 64, "packed", "fa4|triton"),
    "bf16-d64-batched": (torch.bfloat16, 64, "batched", "fa4|triton"),
    "fp32-d64-packed": (torch.float32, 64, "packed", "triton"),
    "bf16-d80-packed": (torch.bfloat16, 80, "packed", "triton"),
    "bf16-d64-key-mask-holes": (torch.bfloat16, 64, "key_mask", "chunked"),
}


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "dim", "layout", "expected"), GPU_DISPATCH_CASES.values(), ids=GPU_DISPATCH_CASES)
def test_auto_choice_per_case_on_gpu(dtype, dim, layout, expected):
    """On a GPU ``auto`` takes FA4 where flash-attn-4 runs the case, else Triton; padding holes go to the chunked
    path. Whichever it takes matches the float64 reference: o and every gradient, dsinks included."""
    from gptoss_kernels.fa4 import fa4_available

    want = ("fa4" if fa4_available() else "triton") if expected == "fa4|triton" else expected
    gen = torch.Generator().manual_seed(0)
    kwargs, window = {}, 128
    if layout == "packed":  # documents of 100 and 201 tokens: neither is a multiple of a tile
        hq, hkv = 16, 2
        q, k, v = (torch.randn(301, h, dim, generator=gen) for h in (hq, hkv, hkv))
        kwargs = dict(cu_seqlens=torch.tensor([0, 100, 301], dtype=torch.int32, device="cuda"), max_seqlen=201)
    else:
        hq, hkv = 8, 2
        q, k, v = (torch.randn(2, 150, h, dim, generator=gen) for h in (hq, hkv, hkv))
        if layout == "key_mask":
            key_mask = torch.ones(2, 150, dtype=torch.bool)
            key_mask[0, 40:47] = False  # a hole in the middle: no contiguous padding
            kwargs = dict(key_mask=key_mask.cuda())
    sinks = torch.rand(hq, generator=gen) * 4 - 1
    name, reason = select_backend(q.cuda(), k.cuda(), kwargs.get("cu_seqlens"), window, key_mask=kwargs.get("key_mask"))
    assert name == want, f"auto chose {name} ({reason}), expected {want}"
    leaves64 = [t.double().cuda().requires_grad_() for t in (q, k, v, sinks)]
    ref = sink_attention_ref(*leaves64, window=window, **kwargs)
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64).cuda()
    want_all = [ref, *torch.autograd.grad(ref, leaves64, grad)]
    leaves = [t.detach().to(dtype if i < 3 else torch.float32).requires_grad_() for i, t in enumerate(leaves64)]
    out = sink_attention(*leaves, window=window, **kwargs)
    got_all = [out, *torch.autograd.grad(out, leaves, grad.to(dtype))]
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for label, got, expected_tensor in zip(("o", "dq", "dk", "dv", "dsinks"), got_all, want_all):
        err = (got.double() - expected_tensor).abs().max().item() / max(expected_tensor.abs().max().item(), 1e-6)
        assert err <= tolerance, f"{name} {label}: relative error {err:.2e} > {tolerance:.0e} ({reason})"


def test_backend_table_is_the_one_dispatch_rule(monkeypatch):
    """``BACKENDS`` is ``auto`` plus the table's rows; a forced row runs exactly when its ``supports`` says
    so and otherwise raises with that row's own reason; ``auto`` names the refusal that sent it on."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert ("auto", *attention.BACKEND_TABLE) == gptoss_kernels.BACKENDS
    assert attention.AUTO_ORDER[-1] == "chunked", "the last auto row must run every call"
    q, k, v, sinks = _qkv()
    call = attention.AttentionCall(q, k, v, sinks, None, None, None, None, None, None, True)
    for name, row in attention.BACKEND_TABLE.items():
        why_not = row.supports(call)
        if why_not is None:
            assert select_backend(q, k, None, None, backend=name) == (name, "requested")
        else:
            with pytest.raises(ValueError, match=re.escape(f"backend='{name}' cannot run this case: {why_not}")):
                select_backend(q, k, None, None, backend=name)
    triton_refusal = attention.BACKEND_TABLE["triton"].supports(call._replace(forced=False))
    assert select_backend(q, k, None, None) == ("chunked", f"auto: {triton_refusal}")


def test_dispatcher_uses_no_private_function_of_another_module():
    """The table's rows call the backends' public runners only (STYLE.md 13)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(attention))
    private = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == [], f"attention.py imports private names: {private}"
