"""Sink attention on a CUDA GPU: TFLOP/s of forward and forward+backward for every implementation, one table.

GPT-OSS attention shape (64 q heads, 8 kv heads, head_dim 64), bf16, one document of T tokens per case in the
packed layout (``cu_seqlens``), T 4k / 16k / 64k, full causal and sliding window 128. Rows, same inputs:

- ``triton``: the package's Triton kernel, ``sink_attention(..., backend="triton")``;
- ``fa4``: FA4's ``learnable_sink`` through our dispatcher, ``backend="fa4"`` (flash-attn-4 on SM90+);
- ``hf-fa4``: transformers' own ``attn_implementation="flash_attention_4"`` forward with ``s_aux=sinks`` (it
  casts the sinks to bf16), when transformers finds flash-attn-4;
- ``sdpa-no-sinks``: torch SDPA **without** sinks, the floor and not sink-exact: ``is_causal`` for full layers,
  a boolean band mask for windowed ones (SDPA cannot skip masked tiles, so its windowed time is the full square);
  kv heads expanded inside the call (a copy of under 5% of the time at these sizes);
- ``eager``: transformers' GPT-OSS ``eager_attention_forward`` with sinks, only where its T x T scores fit.

Self-verifying (STYLE.md 7): before any timing every row is checked against the fp32 reference on two packed
documents (o, dq, dk, dv and, for sink-exact rows, dsinks; relative error <= 2e-2), ``sdpa-no-sinks`` against
the reference with ``sinks = -inf``. FLOPs count only the unmasked (query, key) pairs of the causal/window band:
forward ``4 * pairs * Hq * D`` (QK^T and PV), forward+backward ``3.5x`` that (five matmuls backward). Each case
also records the dispatcher's choice (``select_backend``) for its inputs. The part's own time cap
(``--budget-s``) skips, with the reason, any case that would not finish; so does a case whose memory would not fit.

    python benchmarks/bench_triton_attention.py                   # GPU: table + benchmarks/results/attention_gpu.json
    python benchmarks/bench_triton_attention.py --seqlens 4096,16384 --budget-s 60
    TRITON_INTERPRET=1 python benchmarks/bench_triton_attention.py --dry-run --out /tmp/a.json   # CPU logic check

Part of the GPU check kit (``scripts/gpu_check.sh``); without CUDA and without ``--dry-run`` it records a skip.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import NamedTuple

import torch
from gpu_common import FAILED, Bench, parser, relative_error

GPU_SHAPE = SimpleNamespace(hq=64, hkv=8, d=64, window=128, seqlens=(4096, 16384, 65536), verify=(2, 700))
DRY_SHAPE = SimpleNamespace(hq=4, hkv=2, d=64, window=16, seqlens=(40,), verify=(2, 24))
TOLERANCE = 2e-2
GOAL_SEQLEN = 16384  # the goals: Triton fwd+bwd vs FA4 and vs SDPA at 16k
NAMES = ("o", "dq", "dk", "dv", "dsinks")
# Rough sustained rates for the time estimates that guard the budget (H100 bf16), and first-call compile times.
RATE = {"triton": 150e12, "fa4": 300e12, "hf-fa4": 300e12, "sdpa-no-sinks": 150e12, "eager": 30e12}
COMPILE_S = {"triton": 15.0, "fa4": 45.0, "hf-fa4": 45.0, "sdpa-no-sinks": 1.0, "eager": 1.0}


def band_pairs(doc_len: int, window: int | None) -> int:
    """Number of (query, key) pairs a causal (windowed) document of ``doc_len`` tokens attends to."""
    if window is None or window >= doc_len:
        return doc_len * (doc_len + 1) // 2
    return window * (window + 1) // 2 + (doc_len - window) * window


class Inputs(NamedTuple):
    """One packed case: ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, fp32 ``sinks [Hq]``, equal-length documents."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sinks: torch.Tensor
    cu_seqlens: torch.Tensor
    docs: int
    doc_len: int


def make_inputs(shape, docs, doc_len, device, dtype=torch.bfloat16, seed=0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    total = docs * doc_len
    q = torch.randn(total, shape.hq, shape.d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(total, shape.hkv, shape.d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    sinks = torch.rand(shape.hq, device=device, generator=gen) * 4 - 1
    cu = torch.arange(0, total + 1, doc_len, device=device, dtype=torch.int32)
    return Inputs(q, k, v, sinks, cu, docs, doc_len)


# ----------------------------------------------------------------------------------------------- the rows
class Impl(NamedTuple):
    """A row of the table: ``why_not(device) -> reason | None``; ``run(inputs, q, k, v, sinks, window) -> o
    [T, Hq, D]`` (differentiable in the four leaves); ``need_bytes(T, shape, window)``: memory beyond the inputs;
    ``sink_dtype``: the dtype the row really uses for the sinks (the reference is fed the same rounding)."""

    name: str
    why_not: Callable[[str], str | None]
    run: Callable
    sink_exact: bool = True
    need_bytes: Callable[[int, SimpleNamespace, int | None], float] = lambda t, shape, window: 0.0
    sink_dtype: torch.dtype = torch.float32


def _ours(backend):
    def run(x, q, k, v, sinks, window):
        from gptoss_kernels import sink_attention

        return sink_attention(
            q, k, v, sinks, cu_seqlens=x.cu_seqlens, max_seqlen=x.doc_len, window=window, backend=backend
        )

    return run


def _triton_why_not(device):
    try:
        import gptoss_kernels.triton  # noqa: F401
    except ImportError as err:
        return f"triton is not importable ({err})"
    return None


def _fa4_why_not(device):
    from gptoss_kernels.fa4 import fa4_available

    return None if fa4_available() else "flash-attn-4 is not importable on an SM90+ GPU here"


def _hf_fa4_why_not(device):
    try:
        from transformers.utils import is_flash_attn_4_available
    except ImportError:
        return "this transformers has no flash_attention_4"
    if device != "cuda" or not is_flash_attn_4_available():
        return "transformers finds no flash-attn-4 on a CUDA device here"
    return None


def _hf_fa4(x, q, k, v, sinks, window):
    from transformers.integrations.flash_attention import flash_attention_forward

    module = SimpleNamespace(
        is_causal=True, layer_idx=0, training=True, config=SimpleNamespace(_attn_implementation="flash_attention_4")
    )
    out, _ = flash_attention_forward(
        module,
        *(t[None].transpose(1, 2) for t in (q, k, v)),  # transformers hands attention [B, H, T, D]
        None,
        dropout=0.0,
        scaling=q.shape[-1] ** -0.5,
        sliding_window=window,
        s_aux=sinks,
        cu_seq_lens_q=x.cu_seqlens,
        cu_seq_lens_k=x.cu_seqlens,
        max_length_q=x.doc_len,
        max_length_k=x.doc_len,
    )
    return out[0]


def _batched(x, t):
    """``[T, H, D]`` packed equal-length documents -> ``[docs, H, doc_len, D]``."""
    return t.view(x.docs, x.doc_len, *t.shape[1:]).transpose(1, 2)


_MASKS: dict = {}


def _band_mask(doc_len, window, device, dtype=torch.bool):
    """Allowed (query, key) pairs of one document, cached per shape: built outside the timed calls."""
    key = (doc_len, window, str(device), dtype)
    if key not in _MASKS:
        pos = torch.arange(doc_len, device=device)
        allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - (window or doc_len))
        _MASKS.clear()  # one at a time: a 64k mask is 4 GiB
        _MASKS[key] = (
            allowed
            if dtype == torch.bool
            else torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        )
    return _MASKS[key]


def _sdpa(x, q, k, v, sinks, window):
    group = q.shape[1] // k.shape[1]
    qb, kb, vb = (_batched(x, t) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    if window is None or window >= x.doc_len:
        out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=_band_mask(x.doc_len, window, q.device)
        )
    return out.transpose(1, 2).reshape(q.shape)


def _eager(x, q, k, v, sinks, window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(sinks=sinks.to(q.dtype), num_key_value_groups=q.shape[1] // k.shape[1], training=True)
    mask = _band_mask(x.doc_len, window, q.device, q.dtype)[None, None]
    out, _ = eager_attention_forward(module, *(_batched(x, t) for t in (q, k, v)), mask, scaling=q.shape[-1] ** -0.5)
    return out.reshape(q.shape)  # eager returns [docs, doc_len, H, D]


def _sdpa_need(t, shape, window):
    return 0.0 if window is None else 5.0 * t * t  # the bool mask, the additive bf16 mask SDPA makes of it, padding


def _eager_need(t, shape, window):
    return 6.0 * shape.hq * t * t * 2  # scores, logits with the sink column, probs (+ grads), bf16


IMPLS = (  # in priority order: what the goals need runs first when the time cap is near
    Impl("triton", _triton_why_not, _ours("triton")),
    Impl("fa4", _fa4_why_not, _ours("fa4")),
    Impl("sdpa-no-sinks", lambda device: None, _sdpa, sink_exact=False, need_bytes=_sdpa_need),
    Impl("hf-fa4", _hf_fa4_why_not, _hf_fa4, sink_dtype=torch.bfloat16),
    Impl("eager", lambda device: None, _eager, need_bytes=_eager_need, sink_dtype=torch.bfloat16),
)


# ----------------------------------------------------------------------------------------------- checks and cases
def _reference(x, q, k, v, sinks, window):
    from gptoss_kernels import sink_attention_ref

    return sink_attention_ref(q, k, v, sinks, cu_seqlens=x.cu_seqlens, window=window)


def _fwd_bwd(run, x, window, leaves_from, grad):
    leaves = [t.detach().requires_grad_() for t in leaves_from]
    o = run(x, *leaves, window)
    # sdpa-no-sinks never reads the sinks: their gradient is zero, not an error
    return [o, *torch.autograd.grad(o, leaves, grad.to(o.dtype), allow_unused=True, materialize_grads=True)]


def verify(bench: Bench, impl: Impl, shape) -> None:
    """``impl`` vs the fp32 reference on two packed documents, full and windowed; raises on a mismatch."""
    docs, doc_len = shape.verify
    for window in (None, shape.window):
        x = make_inputs(shape, docs, doc_len, bench.device, seed=1)
        grad = torch.randn(x.q.shape, device=bench.device, generator=torch.Generator(bench.device).manual_seed(2))
        sinks = x.sinks.to(impl.sink_dtype).float() if impl.sink_exact else torch.full_like(x.sinks, float("-inf"))
        ref = _fwd_bwd(_reference, x, window, (x.q.float(), x.k.float(), x.v.float(), sinks), grad)
        got = _fwd_bwd(impl.run, x, window, (x.q, x.k, x.v, x.sinks), grad)
        names = NAMES if impl.sink_exact else NAMES[:4]
        for name, actual, expected in zip(names, got, ref):
            bench.check(f"{impl.name} {name} window={window}", relative_error(actual, expected), TOLERANCE)


def _estimate_s(impl: Impl, t: int, window, shape, compiled: bool) -> float:
    flops = 4 * band_pairs(t, window) * shape.hq * shape.d
    if impl.name == "sdpa-no-sinks" and window is not None:
        flops = 4 * t * t * shape.hq * shape.d  # the full square
    calls = 3 * (1 + 3.5)  # warm-up, estimate and one timed call of fwd and of fwd+bwd, at least
    return (0.0 if compiled else COMPILE_S[impl.name]) + calls * flops / RATE[impl.name] + 1.0


def measure(bench: Bench, impl: Impl, shape, t: int, window) -> dict:
    x = make_inputs(shape, 1, t, bench.device)
    leaves = [x.q.detach().requires_grad_(), x.k.detach().requires_grad_(), x.v.detach().requires_grad_()]
    leaves.append(x.sinks.detach().requires_grad_(impl.sink_exact))
    grad = torch.randn_like(x.q)
    wants = leaves if impl.sink_exact else leaves[:3]
    forward = lambda: impl.run(x, *leaves, window)
    with torch.no_grad():
        fwd = bench.time_ms(forward)
    fwd_bwd = bench.time_ms(lambda: torch.autograd.grad(forward(), wants, grad))
    _, peak = bench.peak_bytes(lambda: torch.autograd.grad(forward(), wants, grad))
    flops = 4 * band_pairs(t, window) * shape.hq * shape.d
    return {
        "impl": impl.name,
        "seqlen": t,
        "window": window,
        "sink_exact": impl.sink_exact,
        "fwd_ms": fwd["ms"],
        "fwd_tflops": flops / fwd["ms"] / 1e9,
        "fwd_bwd_ms": fwd_bwd["ms"],
        "fwd_bwd_tflops": 3.5 * flops / fwd_bwd["ms"] / 1e9,
        "peak_gib": None if peak is None else peak / 2**30,
        "reps": fwd_bwd["reps"],
        "first_call_ms": fwd["warmup_ms"],
    }


def _goals(bench: Bench, t: int) -> None:
    """The issue's goals at 16k: Triton fwd+bwd >= 70% of FA4's TFLOP/s and >= 50% of SDPA-without-sinks'."""
    rate = {(r["impl"], r["window"]): r["fwd_bwd_tflops"] for r in bench.rows if r["seqlen"] == t}
    for window in (None, bench.extra["shape"]["window"]):
        ours = rate.get(("triton", window))
        for other, target in (("fa4", 0.7), ("sdpa-no-sinks", 0.5)):
            theirs = rate.get((other, window))
            ratio = None if ours is None or theirs is None else ours / theirs
            bench.goal(
                f"triton / {other} fwd+bwd TFLOP/s, T={t}, window={window}",
                ratio,
                f">= {target}",
                None if ratio is None else ratio >= target,
            )


def body(bench: Bench, seqlens) -> None:
    from gptoss_kernels import select_backend

    shape = DRY_SHAPE if bench.dry_run else GPU_SHAPE
    seqlens = seqlens or shape.seqlens
    bench.extra["shape"] = {"hq": shape.hq, "hkv": shape.hkv, "d": shape.d, "window": shape.window, "dtype": "bf16"}
    bench.extra["dispatch"] = []
    usable = []
    for impl in IMPLS:
        why_not = impl.why_not(bench.device)
        if why_not:
            bench.skip({"impl": impl.name}, why_not)
            continue
        if bench.attempt({"impl": impl.name, "verify": True}, verify, bench, impl, shape) is not FAILED:
            usable.append(impl)
    for window in (None, shape.window):
        for t in seqlens:
            x = make_inputs(shape, 1, t, bench.device)
            name, reason = select_backend(x.q, x.k, x.cu_seqlens, window)
            bench.extra["dispatch"].append({"seqlen": t, "window": window, "backend": name, "reason": reason})
            del x
    compiled = set()
    goal_t = GOAL_SEQLEN if not bench.dry_run else seqlens[-1]
    for impl in usable:
        for window in (None, shape.window):
            for t in sorted(seqlens, key=lambda t: (t != goal_t, t)):  # the goals' length first
                case = {"impl": impl.name, "seqlen": t, "window": window}
                need = impl.need_bytes(t, shape, window) + 12 * t * shape.hq * shape.d * 2  # + inputs, grads, o
                reason = bench.fits_memory(need) or bench.fits_time(
                    _estimate_s(impl, t, window, shape, (impl.name, window) in compiled)
                )
                if reason:
                    bench.skip(case, reason)
                    continue
                row = bench.attempt(case, measure, bench, impl, shape, t, window)
                compiled.add((impl.name, window))
                if row is not FAILED:
                    bench.rows.append(row)
                    print(row, flush=True)
    order = {impl.name: i for i, impl in enumerate(IMPLS)}
    bench.rows.sort(key=lambda r: (order[r["impl"]], r["window"] or 0, r["seqlen"]))
    _goals(bench, goal_t)


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0], default_budget_s=150)
    p.add_argument("--seqlens", help="tokens per case, comma-separated (default 4096,16384,65536)")
    args = p.parse_args(argv)
    seqlens = tuple(int(t) for t in args.seqlens.split(",")) if args.seqlens else None
    bench = Bench("attention", args)
    bench.columns = (
        ("impl", "impl", ""),
        ("seqlen", "T", ""),
        ("window", "window", ""),
        ("fwd_ms", "fwd ms", ".3f"),
        ("fwd_tflops", "fwd TFLOP/s", ".1f"),
        ("fwd_bwd_ms", "fwd+bwd ms", ".3f"),
        ("fwd_bwd_tflops", "fwd+bwd TFLOP/s", ".1f"),
        ("peak_gib", "peak GiB", ".2f"),
        ("sink_exact", "sinks", ""),
    )
    return bench.run(lambda b: body(b, seqlens))


if __name__ == "__main__":
    raise SystemExit(main())
