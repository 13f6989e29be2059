"""Log-probs through GPT-OSS's lm_head on a CUDA GPU: ``selective_logprobs`` vs a full-logit log-softmax.

The loss pass's head at V = 201,088, hidden 2880, bf16 hidden states and weight (trained: its gradient is made),
16k and 64k tokens, forward of the sampled tokens' log-probs and backward of their sum. Rows:
``selective_logprobs`` (ours: one fp32 ``[chunk, V]`` tile at a time, recomputed in backward) and
``full_log_softmax`` (``(hidden @ W.T).float().log_softmax(-1).gather(...)``: the ``[T, V]`` logits held, as a
plain training loop does). Measured: time of one pass and peak allocated above the inputs, the weight gradient
included. A case whose estimated memory does not fit the GPU is listed as not run, with the numbers.

Self-verifying: log-probs and both gradients of each row at 256 tokens are checked against
``selective_logprobs_ref`` in float64 (relative error <= 2e-2) before any timing.

    python benchmarks/bench_gpu_logprobs.py [--tokens 16384,65536] [--out ...] [--budget-s 30]
    python benchmarks/bench_gpu_logprobs.py --dry-run --out /tmp/logprobs.json   # CPU, tiny vocabulary: the logic only
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from gpu_common import FAILED, GIB, Bench, parser, relative_error

GPU_SHAPE = SimpleNamespace(hidden=2880, vocab=201088, tokens=(16384, 65536), verify=256)
DRY_SHAPE = SimpleNamespace(hidden=64, vocab=1000, tokens=(64,), verify=16)
TOLERANCE = 2e-2
# FLOP/s assumed by the time estimate: ours upcasts to fp32 (IEEE unless TF32 is enabled), the full path is bf16.
RATE = {"selective_logprobs": 45e12, "full_log_softmax": 300e12}


def _ours(hidden, weight, ids):
    from gptoss_kernels import selective_logprobs

    return selective_logprobs(hidden, weight, ids)


def _full(hidden, weight, ids):
    logits = (hidden @ weight.T).float()
    return logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)


IMPLS = {"selective_logprobs": _ours, "full_log_softmax": _full}


def _need_bytes(shape, impl: str, tokens: int) -> float:
    weight_and_grad = 2 * shape.vocab * shape.hidden * 2
    if impl == "full_log_softmax":  # bf16 logits, fp32 logits and log-softmax, and their gradients
        return weight_and_grad + tokens * shape.vocab * (2 + 4 + 4 + 4 + 2)
    return weight_and_grad + shape.vocab * shape.hidden * 4 * 2 + 4 * 320 * shape.vocab * 4  # fp32 W copy, dW, tiles


def _inputs(shape, tokens, device, seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(tokens, shape.hidden, device=device, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(shape.vocab, shape.hidden, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    ids = torch.randint(0, shape.vocab, (tokens,), device=device, generator=gen)
    return hidden, weight, ids


def verify(bench: Bench, shape, impl: str) -> None:
    from gptoss_kernels import selective_logprobs_ref

    hidden, weight, ids = _inputs(shape, shape.verify, bench.device, seed=1)
    h64, w64 = (t.double().requires_grad_() for t in (hidden, weight))
    ref = selective_logprobs_ref(h64, w64, ids)
    want = [ref, *torch.autograd.grad(ref.sum(), (h64, w64))]
    h, w = (t.detach().requires_grad_() for t in (hidden, weight))
    logp = IMPLS[impl](h, w, ids)
    got = [logp, *torch.autograd.grad(logp.sum(), (h, w))]
    for name, actual, expected in zip(("logp", "d_hidden", "d_weight"), got, want):
        bench.check(f"{impl} {name}", relative_error(actual, expected), TOLERANCE)


def measure(bench: Bench, shape, impl: str, tokens: int) -> dict:
    hidden, weight, ids = _inputs(shape, tokens, bench.device)
    h, w = hidden.requires_grad_(), weight.requires_grad_()

    def step():
        h.grad = w.grad = None
        IMPLS[impl](h, w, ids).sum().backward()

    timing = bench.time_ms(step, target_ms=300, max_reps=5)
    h.grad = w.grad = None
    _, peak = bench.peak_bytes(step)
    return {
        "impl": impl,
        "tokens": tokens,
        "step_ms": timing["ms"],
        "peak_gib": None if peak is None else peak / GIB,
        "weight_grad_gib": w.numel() * w.element_size() / GIB,
        "reps": timing["reps"],
    }


def body(bench: Bench, tokens_list) -> None:
    shape = DRY_SHAPE if bench.dry_run else GPU_SHAPE
    if tokens_list:
        shape = SimpleNamespace(**{**vars(shape), "tokens": tokens_list})
    bench.extra["shape"] = vars(shape) | {"dtype": "bf16", "tf32": torch.backends.cuda.matmul.allow_tf32}
    verified = [i for i in IMPLS if bench.attempt({"impl": i, "verify": True}, verify, bench, shape, i) is not FAILED]
    for tokens in shape.tokens:
        for impl in verified:
            case = {"impl": impl, "tokens": tokens}
            passes = 4 if impl == "selective_logprobs" else 3  # ours recomputes the logits in backward
            estimate = 3 * passes * 2 * tokens * shape.vocab * shape.hidden / RATE[impl] + 2
            reason = bench.fits_memory(_need_bytes(shape, impl, tokens)) or bench.fits_time(estimate)
            if reason:
                bench.skip(case, reason)
                continue
            row = bench.attempt(case, measure, bench, shape, impl, tokens)
            if row is not FAILED:
                bench.rows.append(row)
                print(row, flush=True)
    rows = {(r["impl"], r["tokens"]): r for r in bench.rows}
    for tokens in shape.tokens:
        ours, full = rows.get(("selective_logprobs", tokens)), rows.get(("full_log_softmax", tokens))
        if ours and full:
            ours["time_vs_full"] = ours["step_ms"] / full["step_ms"]
            ours["peak_vs_full"] = None if ours["peak_gib"] is None else ours["peak_gib"] / full["peak_gib"]


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0], default_budget_s=30)
    p.add_argument("--tokens", help="tokens per case, comma-separated (default 16384,65536)")
    args = p.parse_args(argv)
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else None
    bench = Bench("logprobs", args)
    bench.columns = (
        ("impl", "impl", ""),
        ("tokens", "T", ""),
        ("step_ms", "fwd+bwd ms", ".1f"),
        ("peak_gib", "peak GiB", ".2f"),
        ("weight_grad_gib", "of which dW", ".2f"),
        ("time_vs_full", "time / full", ".2f"),
        ("peak_vs_full", "peak / full", ".2f"),
    )
    return bench.run(lambda b: body(b, tokens))


if __name__ == "__main__":
    raise SystemExit(main())
