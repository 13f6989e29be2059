"""One real-width GPT-OSS-20B decoder layer on a CUDA GPU: bf16 forward+backward with gradient checkpointing.

The layer as training runs it: hidden 2880, 64 query / 8 KV heads of 64, 32 experts top-4 (intermediate 2880),
window 128 (``sliding_attention``) or full (``full_attention``), bf16 weights with fp32 norms (as
``from_pretrained`` keeps them), ``attn_implementation="fa3_sink"`` and ``experts_implementation=
"gptoss_sequential"``, transformers' gradient checkpointing (non-reentrant), one document of T tokens
(16k and 64k). It runs as a one-layer ``GptOssModel`` fed ``inputs_embeds`` with the final norm removed, so
everything measured belongs to the layer.

Self-verifying: at 512 tokens the layer's output and gradients (input, sinks, q_proj, router, both expert
weights) are compared with the same weights run by stock transformers in fp32 (``eager`` attention and
experts), every pass routed to the reference's experts; the error must stay within twice stock's own bf16 error
plus 1e-2 (STYLE.md 3).

Measured per case, beside the arithmetic (``arithmetic()``; docs/scaling.md, "GPU check kit"):

- ``kept_after_forward``: what the checkpointed layer holds between its forward and backward (its output, the
  next layer's checkpoint) vs docs/scaling.md's ``T x 2880 x 2 B`` per layer;
- ``saved``: bytes autograd saves in one un-checkpointed forward (what the recompute holds; counted with
  ``saved_tensors_hooks``, parameters and the input excluded) vs the per-token sum of the layer's saved
  activations;
- ``peak``: peak allocated above the inputs during forward+backward, parameter gradients excluded, vs
  ``saved + backward transients + output``;
- time of one checkpointed forward+backward (forward, recompute, backward);
- ``projection_20b_lora``: 20B in bf16 with LoRA at T tokens on one GPU from the measured layer peak: weights +
  24 checkpoints + one layer's peak + the log-prob head (Unsloth's anchor: 60K tokens on one 80 GB H100).

    python benchmarks/bench_gpu_layer.py [--seqlens 16384,65536] [--out ...] [--budget-s 70]
    python benchmarks/bench_gpu_layer.py --dry-run --out /tmp/layer.json    # CPU, tiny width: the logic only
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from gpu_common import FAILED, GIB, Bench, parser, relative_error

GPU_SHAPE = SimpleNamespace(
    hidden=2880, inter=2880, hq=64, hkv=8, d=64, experts=32, top_k=4, window=128, seqlens=(16384, 65536), verify=512
)
DRY_SHAPE = SimpleNamespace(
    hidden=64, inter=64, hq=4, hkv=2, d=16, experts=4, top_k=2, window=8, seqlens=(48,), verify=24
)
KINDS = ("sliding_attention", "full_attention")
GPT_OSS_20B = SimpleNamespace(params=20.9e9, layers=24, vocab=201088)
RATE = 150e12  # sustained bf16 FLOP/s assumed by the time estimate (MoE slices + attention)


def arithmetic(shape, tokens: int, window: int | None) -> dict:
    """Bytes of one layer at ``tokens`` tokens, term by term (bf16 activations, fp32 norm weights)."""
    h, q, kv, i, k = shape.hidden, shape.hq * shape.d, shape.hkv * shape.d, shape.inter, shape.top_k
    per_token = {
        # RMSNorm upcasts to fp32 and keeps the fp32 input and the normalised fp32 product; its bf16 output is
        # saved by the projections (attention) and by the router and experts (MLP): 10 B per hidden unit each.
        "norms": 2 * (4 * h + 4 * h + 2 * h),
        # attention: RoPE'd q and k (packed copies), v, the output o and the fp32 lse; RoPE keeps cos and sin.
        "attention": 2 * q + 2 * kv + 2 * kv + 2 * q + 4 * shape.hq + 2 * shape.d,
        # router: logits [E] and the top-k softmax (bf16), top-k indices (int64).
        "router": 2 * shape.experts + 2 * k + 8 * k,
        # experts op: the [T*K, 2I] gate/up pre-activations and the sorted routing weights (bf16).
        "experts": 2 * k * 2 * i + 2 * k,
    }
    saved = sum(per_token.values())
    # Backward's largest transient sits at its start (the experts' backward, the last forward op first):
    # d_hidden in fp32, grad_out in the activation dtype, the experts plan (two int64 [T*K]).
    transients = 4 * h + 2 * h + 16 * k
    checkpoint = 2 * h  # docs/scaling.md: "a layer keeps its input, T x 2880 x 2 B"
    return {
        "per_token_bytes": per_token,
        "checkpoint_bytes": tokens * checkpoint,
        "saved_bytes": tokens * saved,
        "peak_bytes": tokens * (saved + transients + checkpoint),  # + the output the layer hands on
    }


def flops(shape, tokens: int, window: int | None) -> float:
    """Forward FLOPs of the layer; a checkpointed forward+backward is 4x (forward, recompute, 2x backward)."""
    h, q, kv = shape.hidden, shape.hq * shape.d, shape.hkv * shape.d
    proj = 2 * tokens * (h * (q + 2 * kv) + q * h)
    experts = 2 * tokens * shape.top_k * (h * 2 * shape.inter + shape.inter * h)
    pairs = tokens * (tokens + 1) // 2 if window is None or window >= tokens else tokens * window
    return proj + experts + 4 * pairs * shape.hq * shape.d


def build(shape, kind: str, device: str, dtype=torch.bfloat16, seed: int = 0):
    """A one-layer ``GptOssModel`` of ``kind`` with fa3_sink attention and the sequential experts op."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssModel

    import trl_gptoss  # noqa: F401  (registers fa3_sink and gptoss_sequential)

    config = GptOssConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.inter,
        num_attention_heads=shape.hq,
        num_key_value_heads=shape.hkv,
        head_dim=shape.d,
        num_local_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        sliding_window=shape.window,
        num_hidden_layers=1,
        layer_types=[kind],
        vocab_size=512,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = GptOssModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.uniform_(-1.0, 3.0)  # large enough that ignoring them is visibly wrong
            elif "norm" not in name:
                param.normal_(0.0, 0.02 if param.dim() < 3 else param.shape[-2] ** -0.5)
    model.norm = torch.nn.Identity()  # the layer's output is what is measured
    model.to(dtype)
    for layer in model.layers:  # from_pretrained keeps these in fp32 (_keep_in_fp32_modules)
        layer.input_layernorm.float()
        layer.post_attention_layernorm.float()
    model.set_attn_implementation("fa3_sink")
    model.set_experts_implementation("gptoss_sequential")
    return model.train()


def _watched(model) -> dict[str, torch.nn.Parameter]:
    layer = model.layers[0]
    return {
        "sinks": layer.self_attn.sinks,
        "q_proj": layer.self_attn.q_proj.weight,
        "router": layer.mlp.router.weight,
        "gate_up_proj": layer.mlp.experts.gate_up_proj,
        "down_proj": layer.mlp.experts.down_proj,
    }


def _outputs_and_grads(model, x, grad_out) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().to(next(model.parameters()).dtype).requires_grad_()
    pos = torch.arange(x.shape[1], device=x.device)[None]
    out = model(inputs_embeds=x, position_ids=pos).last_hidden_state
    out.backward(grad_out.to(out.dtype))
    return {"out": out.detach(), "d_input": x.grad, **{k: p.grad for k, p in _watched(model).items()}}


def verify(bench: Bench, shape, kind: str) -> None:
    """Ours (bf16, fa3_sink, gptoss_sequential) vs stock transformers fp32 (eager attention and experts) on the
    same weights; tolerance: twice stock's own bf16 error plus 1e-2, per tensor."""
    from trl_gptoss.experts.routing import record_routing, replay_routing

    ours = build(shape, kind, bench.device)
    stock32 = copy.deepcopy(ours).float()
    stock32.set_attn_implementation("eager")
    stock32.set_experts_implementation("eager")
    stock16 = copy.deepcopy(stock32).to(torch.bfloat16)
    gen = torch.Generator(bench.device).manual_seed(3)
    x = torch.randn(1, shape.verify, shape.hidden, device=bench.device, generator=gen)
    grad_out = torch.randn(x.shape, device=bench.device, generator=gen)
    # top-k is a discrete choice: a near-tie flipped by bf16 rounding is not an error, so every pass routes each
    # token to the fp32 reference's experts (routing replay; the weights still come from each pass's own logits)
    with record_routing(stock32) as routes:
        want = _outputs_and_grads(stock32, x, grad_out)
    with replay_routing(ours, routes):
        got = _outputs_and_grads(ours, x, grad_out)
    with replay_routing(stock16, routes):
        yardstick = _outputs_and_grads(stock16, x, grad_out)
    for name, expected in want.items():
        tolerance = 2 * relative_error(yardstick[name], expected) + 1e-2
        bench.check(f"{kind} {name}", relative_error(got[name], expected), tolerance)


def _checkpointing(model, on: bool) -> None:
    """transformers' (non-reentrant) gradient checkpointing, by its 5.23 name or the older one."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def _saved_bytes(model, x, pos) -> int:
    """Bytes of every distinct storage autograd saves in one un-checkpointed forward (not parameters or x)."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    _checkpointing(model, False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(inputs_embeds=x, position_ids=pos).last_hidden_state
    del out
    return sum(storages.values())


def measure(bench: Bench, model, shape, kind: str, tokens: int) -> dict:
    window = shape.window if kind == "sliding_attention" else None
    gen = torch.Generator(bench.device).manual_seed(4)
    x = torch.randn(1, tokens, shape.hidden, device=bench.device, dtype=torch.bfloat16, generator=gen)
    x.requires_grad_()
    grad_out = torch.randn(x.shape, device=bench.device, dtype=torch.bfloat16, generator=gen)
    pos = torch.arange(tokens, device=bench.device)[None]
    param_grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    _checkpointing(model, True)
    kept = {}

    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        before = torch.cuda.memory_allocated() if bench.device == "cuda" else 0
        out = model(inputs_embeds=x, position_ids=pos).last_hidden_state
        if bench.device == "cuda":
            kept["bytes"] = torch.cuda.memory_allocated() - before
        out.backward(grad_out)

    timing = bench.time_ms(step, target_ms=1000, max_reps=3)
    model.zero_grad(set_to_none=True)
    x.grad = None
    _, peak = bench.peak_bytes(step)
    saved = _saved_bytes(model, x.detach(), pos)
    model.zero_grad(set_to_none=True)
    arith = arithmetic(shape, tokens, window)
    step_flops = 4 * flops(shape, tokens, window)
    peak_act = None if peak is None else peak - param_grad_bytes - tokens * shape.hidden * 2  # minus x.grad
    row = {
        "kind": kind,
        "tokens": tokens,
        "step_ms": timing["ms"],
        "tflops": step_flops / timing["ms"] / 1e9,
        "reps": timing["reps"],
        "kept_after_forward_gib": kept["bytes"] / GIB if "bytes" in kept else None,
        "checkpoint_arith_gib": arith["checkpoint_bytes"] / GIB,
        "saved_gib": saved / GIB,
        "saved_arith_gib": arith["saved_bytes"] / GIB,
        "peak_gib": None if peak is None else peak / GIB,
        "param_grads_gib": param_grad_bytes / GIB,
        "peak_act_gib": None if peak_act is None else peak_act / GIB,
        "peak_arith_gib": arith["peak_bytes"] / GIB,
    }
    row["saved_vs_arith"] = saved / arith["saved_bytes"]
    row["peak_vs_arith"] = None if peak_act is None else peak_act / arith["peak_bytes"]
    return row


def projection(bench: Bench, shape) -> None:
    """20B, bf16 weights, LoRA (no base gradients), one GPU, from the full-attention layer's peak (measured on a
    GPU, the arithmetic in a dry run)."""
    for row in bench.rows:
        if row["kind"] != "full_attention":
            continue
        tokens, measured = row["tokens"], row["peak_act_gib"] is not None
        terms = {
            "weights_bf16_gib": GPT_OSS_20B.params * 2 / GIB,
            "checkpoints_gib": GPT_OSS_20B.layers * tokens * shape.hidden * 2 / GIB,
            "layer_peak_gib": row["peak_act_gib"] if measured else row["peak_arith_gib"],
            # selective_logprobs: a transient fp32 copy of lm_head plus two fp32 [320, V] tiles
            "logprob_head_gib": (GPT_OSS_20B.vocab * shape.hidden * 4 + 2 * 320 * GPT_OSS_20B.vocab * 4) / GIB,
        }
        total = sum(terms.values())
        source = "measured layer peak" if measured else "arithmetic layer peak"
        bench.extra.setdefault("projection_20b_lora", []).append(
            {"tokens": tokens, **terms, "total_gib": total, "source": source}
        )
        name = f"20B bf16 LoRA at {tokens} tokens fits one 80 GB GPU ({source})"
        bench.goal(name, total, "<= 74.5 GiB", total <= 74.5)


def body(bench: Bench, seqlens) -> None:
    shape = DRY_SHAPE if bench.dry_run else GPU_SHAPE
    seqlens = seqlens or shape.seqlens
    bench.extra["shape"] = vars(shape) | {"dtype": "bf16", "attention": "fa3_sink", "experts": "gptoss_sequential"}
    verified = [k for k in KINDS if bench.attempt({"kind": k, "verify": True}, verify, bench, shape, k) is not FAILED]
    for kind in verified:
        model = bench.attempt({"kind": kind, "build": True}, build, shape, kind, bench.device)
        for tokens in seqlens if model is not FAILED else ():
            window = shape.window if kind == "sliding_attention" else None
            case = {"kind": kind, "tokens": tokens}
            estimate = 8 * flops(shape, tokens, window) / RATE + 5  # warm-up + 1 rep + the peak step, each 4x fwd
            reason = bench.fits_memory(1.3 * arithmetic(shape, tokens, window)["peak_bytes"] + 2 * GIB)
            reason = reason or bench.fits_time(estimate)
            if reason:
                bench.skip(case, reason)
                continue
            row = bench.attempt(case, measure, bench, model, shape, kind, tokens)
            if row is not FAILED:
                bench.rows.append(row)
                print(row, flush=True)
        del model
    for row in bench.rows:
        if row["peak_vs_arith"] is not None:
            ratio = row["peak_vs_arith"]
            met = abs(ratio - 1) <= 0.15
            bench.goal(f"{row['kind']} {row['tokens']} peak / arithmetic", ratio, "within 15%", met)
    projection(bench, shape)


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0], default_budget_s=70)
    p.add_argument("--seqlens", help="tokens per case, comma-separated (default 16384,65536)")
    args = p.parse_args(argv)
    seqlens = tuple(int(t) for t in args.seqlens.split(",")) if args.seqlens else None
    bench = Bench("layer", args)
    bench.columns = (
        ("kind", "layer", ""),
        ("tokens", "T", ""),
        ("step_ms", "fwd+bwd ms (GC)", ".1f"),
        ("tflops", "TFLOP/s", ".0f"),
        ("kept_after_forward_gib", "kept GiB", ".3f"),
        ("checkpoint_arith_gib", "arith GiB", ".3f"),
        ("saved_gib", "saved GiB", ".2f"),
        ("saved_arith_gib", "arith GiB", ".2f"),
        ("peak_act_gib", "peak GiB", ".2f"),
        ("peak_arith_gib", "arith GiB", ".2f"),
        ("param_grads_gib", "+ param grads GiB", ".2f"),
    )
    return bench.run(lambda b: body(b, seqlens))


if __name__ == "__main__":
    raise SystemExit(main())
