"""Prove that a weight push reaches every parameter group of a running vLLM server, never assume it.

``check_sync(engines, model)`` perturbs one parameter group at a time *in the trainer's model* (a seeded
Gaussian delta, ``scale`` times each tensor's RMS, rounded to the server's dtype), pushes the whole model the
way training does, and compares each server's prompt log-probs with the trainer's own recomputation:

- ``effect = max |logp_trainer(perturbed) - logp_trainer(checkpoint)|``: how far the perturbation moves the
  log-probs; a group whose push does not land leaves the server that far from the trainer.
- ``error = max |logp_server - logp_trainer(perturbed)|``: ``ok`` when ``<= tolerance``.
- ``moved = <d_server, d_trainer> / <d_trainer, d_trainer>`` with ``d_server`` the server's log-prob change
  caused by the push (vs its ``baseline`` scores) and ``d_trainer`` the trainer's: the fraction of the
  perturbation's effect the server reproduces (1: it landed; 0: the server did not move). Rounding noise
  uncorrelated with the perturbation averages out of it, so it tells a stale group apart from a noisy one
  whatever the dtype. Not ``ok``: ``stale`` when ``|moved| < 0.1`` (the server kept the old weights of that
  group), ``mismatch`` otherwise (part of the group landed, or the numerics differ beyond the tolerance).
- ``blind`` when ``effect < 10 * tolerance``: a stale group could pass; raise ``scale``.

``moved_tolerance`` (for bf16 servers, whose rounding differs from the trainer's by more than any useful
absolute tolerance on some models): a group also passes when ``|moved - 1| <= moved_tolerance``, and the
baseline and restored rows (server vs trainer, no perturbation) become information; the fresh row (server vs
server, the same numerics on both sides) stays judged by ``tolerance``. It must stay below
``MAX_MOVED_TOLERANCE = 1 - STALE_MOVED``, and the stale verdict is decided before it: a server that kept its
old weights (``moved`` ~ 0) never passes.

Around the groups: ``as_found`` (the server before anything is pushed vs the checkpoint; information only),
``baseline`` (after pushing the unperturbed model), ``restored`` (after pushing it again at the end; the server
is left serving the checkpoint) and, when given, ``fresh`` (the restored server vs the log-probs of a server
freshly started from the checkpoint). Each group's tensors are restored in the model from a host copy
after its push (peak extra host memory: the largest group, the experts for GPT-OSS, in bf16 when its values
are bf16 numbers).

The maximum is over every scored token of every prompt (``prompts``: token-id lists; the first token of each
has no prefix and is not scored).

Sharded models (FSDP2 ``DTensor`` parameters): ``check_sync`` is then collective. Every rank calls it with its
shard of the same model and the same arguments; only rank 0 talks to the servers (its ``engines``; the other
ranks may pass ``[]``), every rank joins the forwards, the pushes' gathers and the perturbation (each rank
perturbs its own shard from the full tensor's seeded noise), and every rank returns rank 0's report. A failure
on rank 0 while talking to a server is raised on every rank (no rank is left inside a collective).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trl_gptoss.rollout.weights.names import checkpoint_name, unwrap
from trl_gptoss.rollout.weights.sync import push_model

GROUPS = ("embeddings", "attention", "sinks", "router", "experts", "norms", "lm_head")
BLIND_FACTOR = 10.0  # a perturbation must move the log-probs this many tolerances for the check to see it
STALE_MOVED = 0.1  # a server that reproduces less than this fraction of the perturbation's effect kept old weights
MAX_MOVED_TOLERANCE = 1.0 - STALE_MOVED  # |moved - 1| <= this must never admit a stale server


def parameter_group(name: str) -> str | None:
    """The parameter group of a checkpoint name (``model.layers.0.self_attn.sinks`` -> ``"sinks"``); ``None``
    for a name outside the GPT-OSS layout."""
    if name.startswith("lm_head."):
        return "lm_head"
    if ".embed_tokens." in f".{name}":
        return "embeddings"
    if name.endswith("self_attn.sinks"):
        return "sinks"
    if ".self_attn." in name and any(f".{p}_proj." in name for p in "qkvo"):
        return "attention"
    if ".mlp.router." in name:
        return "router"
    if ".mlp.experts." in name:
        return "experts"
    if "norm" in name.rsplit(".", 2)[-2]:
        return "norms"
    return None


def grouped_parameters(model) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """``{group: [(checkpoint_name, parameter), ...]}`` in ``GROUPS`` order (groups the model lacks, e.g.
    ``lm_head`` when tied to the embeddings, are absent); a parameter outside every group is an error."""
    groups: dict[str, list] = {g: [] for g in GROUPS}
    for name, param in unwrap(model).named_parameters():
        target = checkpoint_name(name)
        if target is None:
            continue
        group = parameter_group(target)
        if group is None:
            raise ValueError(
                f"check-sync: parameter {target!r} belongs to no parameter group {GROUPS}; the check only knows "
                "the GPT-OSS checkpoint layout"
            )
        groups[group].append((target, param))
    return {g: params for g, params in groups.items() if params}


def random_prompts(vocab: int, count: int, length: int, *, seed: int = 0, exclude=()) -> list[list[int]]:
    """``count`` token-id lists of ``length`` ids drawn uniformly from ``[0, vocab)`` minus ``exclude``."""
    allowed = torch.ones(vocab, dtype=torch.bool)
    allowed[[i for i in exclude if 0 <= i < vocab]] = False
    pool = allowed.nonzero().squeeze(1)
    if len(pool) < 2 or length < 2 or count < 1:
        raise ValueError(f"need count >= 1, length >= 2 and 2+ usable token ids (got {count}, {length}, {len(pool)})")
    generator = torch.Generator().manual_seed(seed)
    return [pool[torch.randint(len(pool), (length,), generator=generator)].tolist() for _ in range(count)]


def trainer_logprobs(model, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """The trainer's log-prob of every token of every prompt given the ones before it, one forward per prompt,
    ``log_softmax`` in float64: ``[sum(len(p) - 1)]`` (the layout ``server_logprobs`` returns). Collective for
    an FSDP2 model (every rank, the same prompts); its parameters are sharded again afterwards."""
    device = next(unwrap(model).parameters()).device
    values = []
    with torch.no_grad():
        for ids in prompts:
            ids_t = torch.tensor([list(ids)], device=device)
            logits = model(input_ids=ids_t).logits[0, :-1].double()
            values.append(torch.log_softmax(logits, -1).gather(1, ids_t[0, 1:, None]).squeeze(1).cpu())
    _reshard(model)
    return torch.cat(values)


def _reshard(model) -> None:
    """Back to shards after an FSDP2 forward: the root module keeps its parameters unsharded after a forward
    (no ``reshard_after_forward`` at the root), and a perturbation written into those gathered copies would
    be dropped at the next reshard. A no-op for a model without ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    for module in unwrap(model).modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def server_logprobs(engine, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """``engine.score`` of every prompt, concatenated: ``[sum(len(p) - 1)]`` float64."""
    return torch.tensor([v for ids in prompts for v in engine.score(ids)], dtype=torch.float64)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _over(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> int:
    return int(((a - b).abs() > tolerance).sum())


@dataclass
class ServerResult:
    """One server's numbers in one check: ``error`` vs the expected trainer log-probs; ``verdict``: ok / stale /
    mismatch / blind / info; ``over``: how many tokens exceed the tolerance (one or two: likely a router
    near-tie, see docs/troubleshooting.md). Group checks only: ``error_old`` vs the unperturbed model's
    log-probs, ``moved`` (module docstring)."""

    url: str
    error: float
    verdict: str
    error_old: float | None = None
    over: int = 0  # scored tokens with |logp_server - logp_expected| > tolerance
    moved: float | None = None


@dataclass
class Check:
    """One row of the report: ``kind`` as_found / baseline / group / restored / fresh; ``effect`` and
    ``tensors`` for a group."""

    kind: str
    group: str | None = None
    tensors: int | None = None
    effect: float | None = None
    servers: list[ServerResult] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.group if self.kind == "group" else self.kind.replace("_", " ")


@dataclass
class SyncReport:
    """Everything ``check_sync`` measured; ``ok``: every judged row of every server passed."""

    servers: list[dict]
    tolerance: float
    moved_tolerance: float | None
    scale: float
    seed: int
    prompts: int
    tokens: int
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.verdict in ("ok", "info") for c in self.checks for s in c.servers)

    @property
    def failed(self) -> list[str]:
        """``"label@url: verdict"`` for every failed row."""
        return [
            f"{c.label}@{s.url}: {s.verdict}" for c in self.checks for s in c.servers if s.verdict not in ("ok", "info")
        ]

    def to_dict(self) -> dict:
        checks = [
            {
                "check": c.kind,
                "group": c.group,
                "tensors": c.tensors,
                "effect": c.effect,
                "servers": [vars(s) for s in c.servers],
            }
            for c in self.checks
        ]
        fields = ("servers", "tolerance", "moved_tolerance", "scale", "seed", "prompts", "tokens")
        return {**{f: getattr(self, f) for f in fields}, "ok": self.ok, "failed": self.failed, "checks": checks}


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """An exact host copy, in bfloat16 when that holds every value (a bf16 checkpoint trained in fp32): half
    the host memory for the group being checked."""
    if tensor.dtype == torch.float32:
        low = tensor.to(torch.bfloat16)
        if torch.equal(low.to(torch.float32), tensor):
            return low.cpu()
    return tensor.to("cpu", copy=True)


def _perturb(params, scale: float, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Add ``scale * rms(p) * N(0, 1)`` (seeded per name; rounded through ``dtype``, the server's, so both sides
    hold the same values) to each parameter in place; returns host copies of the old values (of this rank's
    shard for a ``DTensor``, whose noise and RMS are those of the full tensor: the same on every layout)."""
    saved = []
    with torch.no_grad():
        for name, param in params:
            sharded = _is_dtensor(param)
            saved.append(_host_copy(param.detach().to_local() if sharded else param.detach()))
            full = param.detach().full_tensor() if sharded else param.detach()  # collective for a DTensor
            rms = float(full.float().pow(2).mean().sqrt()) or 1.0  # 0 for an all-zero bias
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            noise = torch.randn(full.shape, generator=generator).to(full.device)
            moved = (full.float() + scale * rms * noise).to(dtype).to(param.dtype)
            if sharded:  # this rank's shard of the full result; src_data_rank=None: no communication
                moved = _distribute(moved, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(moved)
            del noise, moved, full
    return saved


def _restore(params, saved: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for (_, param), old in zip(params, saved, strict=True):
            local = param.to_local() if _is_dtensor(param) else param
            local.copy_(old.to(local.device, local.dtype))


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _distribute(tensor, mesh, placements, **kwargs):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(tensor, mesh, placements, **kwargs)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _on_lead(call: Callable):
    """``call()`` on rank 0 (the rank that talks to the servers), ``None`` elsewhere. Collective when
    distributed: every rank learns whether it failed, and every rank raises if it did."""
    result, error = None, None
    if not _distributed() or dist.get_rank() == 0:
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 (re-raised below, after every rank knows)
            error = exc
    if _distributed() and _broadcast(error is not None) and error is None:
        raise RuntimeError("check-sync: rank 0 failed while talking to the servers; its log has the error")
    if error is not None:
        raise error
    return result


def _broadcast(obj):
    """Rank 0's ``obj`` on every rank (identity when not distributed)."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _scores(engines, prompts) -> list[torch.Tensor]:
    """Every server's ``server_logprobs`` on rank 0; ``[]`` on the other ranks."""
    return _on_lead(lambda: [server_logprobs(e, prompts) for e in engines]) or []


def _judge(engines, scores, expected, report, kind) -> list[ServerResult]:
    """One row: each server's ``scores`` against ``expected`` (one tensor, or one per server)."""
    results, tolerance = [], report.tolerance
    informative = kind == "as_found" or (report.moved_tolerance is not None and kind in ("baseline", "restored"))
    for index, (engine, score) in enumerate(zip(engines, scores, strict=True)):
        reference = expected[index] if isinstance(expected, list) else expected
        error = _max_abs(score, reference)
        verdict = "info" if informative else ("ok" if error <= tolerance else "mismatch")
        results.append(ServerResult(engine.base_url, error, verdict, over=_over(score, reference, tolerance)))
    return results


def _judge_group(engines, all_scores, expected, base, baseline, report) -> list[ServerResult]:
    """A group row: ``all_scores``: each server's scores after the perturbed push; ``baseline``: after the
    unperturbed one (``moved``'s origin)."""
    results, tolerance, moved_tolerance = [], report.tolerance, report.moved_tolerance
    d_trainer = expected - base
    effect = float(d_trainer.abs().max())
    for engine, origin, scores in zip(engines, baseline, all_scores, strict=True):
        error = _max_abs(scores, expected)
        moved = float((scores - origin) @ d_trainer / (d_trainer @ d_trainer)) if effect > 0 else 0.0
        if effect < BLIND_FACTOR * tolerance:
            verdict = "blind"
        elif error <= tolerance:
            verdict = "ok"
        elif abs(moved) < STALE_MOVED:  # before the moved tolerance: a server that did not move never passes
            verdict = "stale"
        elif moved_tolerance is not None and abs(moved - 1) <= moved_tolerance:
            verdict = "ok"
        else:
            verdict = "mismatch"
        over = _over(scores, expected, tolerance)
        results.append(ServerResult(engine.base_url, error, verdict, _max_abs(scores, base), over, moved))
    return results


def default_push(engines) -> Callable:
    """Push to every engine the way training does: one ``push_model`` (one gather) feeding one pusher each."""
    return lambda model: push_model(lambda: [e.pusher() for e in engines], model)


def check_sync(
    engines,
    model,
    prompts: Sequence[Sequence[int]],
    *,
    push: Callable | None = None,
    groups: Sequence[str] = GROUPS,
    scale: float = 0.2,
    seed: int = 0,
    tolerance: float = 1e-4,
    moved_tolerance: float | None = None,
    fresh: torch.Tensor | str | None = None,
) -> SyncReport:
    """Run the check described in the module docstring: single process, or collective when ``torch.distributed``
    is initialized (every rank calls it with the same arguments; see the module docstring).

    ``engines``: ``VLLMServerEngine``s serving ``model``'s checkpoint (read on rank 0 only); ``model``: the
    trainer's model in eval mode, whole or FSDP2-sharded; ``push(model)``: the push under test, collective when
    distributed (default ``default_push(engines)``); ``groups``: which ``GROUPS`` to perturb; ``fresh``: a fresh
    server's ``server_logprobs`` of ``prompts``, or ``"as_found"`` when each server was started from the
    checkpoint and not pushed to since (its scores before the check are a fresh server's): the ``fresh`` row
    compares the restored servers with it. The model is left as it came; the servers are left serving it (the
    ``restored`` push). Returns rank 0's report on every rank.
    """
    _check_arguments(groups, scale, tolerance, moved_tolerance, fresh)
    lead = not _distributed() or dist.get_rank() == 0
    engines = list(engines) if lead else []  # only rank 0 talks to the servers
    push = push or default_push(engines)
    servers = _on_lead(lambda: _describe(engines))
    dtype = getattr(torch, _broadcast(servers[0]["dtype"] if servers else None))
    by_group = grouped_parameters(model)
    base = trainer_logprobs(model, prompts)  # collective forward when sharded
    report = SyncReport(servers or [], tolerance, moved_tolerance, scale, seed, len(prompts), len(base))
    found = _scores(engines, prompts)
    report.checks.append(Check("as_found", servers=_judge(engines, found, base, report, "as_found")))
    push(model)
    baseline = _scores(engines, prompts)
    report.checks.append(Check("baseline", servers=_judge(engines, baseline, base, report, "baseline")))
    try:
        for group in (g for g in GROUPS if g in groups and g in by_group):
            run = (engines, model, prompts, push, dtype)
            report.checks.append(_check_group(run, by_group[group], group, base, baseline, report))
    finally:
        push(model)  # the model is whole again here: leave every server on the checkpoint
    scores = _scores(engines, prompts)
    report.checks.append(Check("restored", servers=_judge(engines, scores, base, report, "restored")))
    if fresh is not None:
        reference = found if isinstance(fresh, str) and fresh == "as_found" else fresh
        report.checks.append(Check("fresh", servers=_judge(engines, scores, reference, report, "fresh")))
    return _broadcast(report)


def _check_arguments(groups, scale, tolerance, moved_tolerance, fresh) -> None:
    """The same errors on every rank, before any collective."""
    if not (0 < scale < math.inf and 0 < tolerance < math.inf and (moved_tolerance is None or moved_tolerance > 0)):
        raise ValueError(
            f"scale, tolerance and moved_tolerance must be finite and > 0, got {scale}, {tolerance}, {moved_tolerance}"
        )
    if moved_tolerance is not None and moved_tolerance >= MAX_MOVED_TOLERANCE:
        raise ValueError(
            f"moved_tolerance={moved_tolerance} could pass a server that kept its old weights (stale: |moved| < "
            f"{STALE_MOVED}); give a value below {MAX_MOVED_TOLERANCE:g}, e.g. 0.2"
        )
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise ValueError(f"groups: unknown parameter group {unknown[0]!r}; choose from {GROUPS}")
    if isinstance(fresh, str) and fresh != "as_found":
        raise ValueError(f"fresh must be a tensor of log-probs, 'as_found' or None, got {fresh!r}")


def _describe(engines) -> list[dict]:
    if not engines:
        raise ValueError("check_sync needs at least one server engine (on rank 0)")
    return [{"url": e.base_url, "dtype": str(e.pusher().dtype).removeprefix("torch.")} for e in engines]


def _check_group(run, params, group, base, baseline, report) -> Check:
    """Perturb ``params`` (one group), push, score both sides, restore the model. ``run``: ``(engines, model,
    prompts, push, server dtype)``."""
    engines, model, prompts, push, dtype = run
    saved = _perturb(params, report.scale, report.seed, dtype)
    try:
        push(model)
        expected = trainer_logprobs(model, prompts)
    finally:
        _restore(params, saved)
    servers = _judge_group(engines, _scores(engines, prompts), expected, base, baseline, report)
    return Check("group", group, len(params), _max_abs(expected, base), servers)


def format_report(report: SyncReport) -> str:
    """The report as a table per server (the ``trl-gptoss check-sync`` output)."""
    lines = [
        f"{report.prompts} prompt(s), {report.tokens} scored tokens; perturbation {report.scale} x RMS per tensor "
        f"(seed {report.seed}); tolerance {report.tolerance:.1e}"
        + ("" if report.moved_tolerance is None else f", moved within 1 +- {report.moved_tolerance}"),
        "  effect: max |logp change| the perturbation causes in the trainer",
        "  |server-trainer|: max |logp_server - logp_trainer|; over: tokens above the tolerance",
        "  moved: fraction of the perturbation's effect the server reproduces (1 landed, 0 stale)",
    ]
    for index, server in enumerate(report.servers):
        lines += ["", f"server {server['url']} ({server['dtype']})"]
        lines.append(
            f"  {'check':<12} {'tensors':>7} {'effect':>9} {'|server-trainer|':>17} {'over':>5} {'moved':>7}  verdict"
        )
        for check in report.checks:
            result = check.servers[index]
            effect = "-" if check.effect is None else f"{check.effect:.2e}"
            moved = "-" if result.moved is None else f"{result.moved:.3f}"
            tensors = "-" if check.tensors is None else str(check.tensors)
            lines.append(
                f"  {check.label:<12} {tensors:>7} {effect:>9} {result.error:>17.2e} {result.over:>5} {moved:>7}  "
                f"{_EXPLANATIONS[result.verdict]}"
            )
    verdict = "PASS: every parameter group reached every server" if report.ok else "FAIL: " + "; ".join(report.failed)
    return "\n".join([*lines, "", verdict])


_EXPLANATIONS = {
    "ok": "ok",
    "info": "info (not judged)",
    "stale": "STALE: the server kept the old weights of this group",
    "mismatch": "MISMATCH: beyond the tolerance (moved ~1: numerics or a router tie; else partly landed)",
    "blind": "BLIND: the perturbation moves log-probs too little to tell (raise --scale)",
}
