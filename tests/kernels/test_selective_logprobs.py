"""selective_logprobs (chunked, recomputing backward) vs the materialising float64 reference and TRL's own math:
log-probs, entropies and the gradients of hidden, weight and bias; low precision; memory; argument errors."""

import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

from gptoss_kernels import selective_logprobs, selective_logprobs_ref
from gptoss_kernels.logprobs import default_chunk_size

F64 = torch.float64
NAMES = ("logp", "entropy", "d_hidden", "d_weight", "d_bias")


@dataclass(frozen=True)
class Case:
    lead: tuple = (37,)  # token_ids shape; hidden is lead + (H,)
    hidden: int = 12
    vocab: int = 50
    chunk: int | None = 8
    temperature: float = 1.0
    bias: bool = True


CASES = {
    "n37-c8-T1-bias": Case(),
    "n37-c8-T0.7-bias": Case(temperature=0.7),
    "n64-c16-T1.3-nobias": Case(lead=(64,), chunk=16, temperature=1.3, bias=False),
    "n1-c8": Case(lead=(1,)),
    "n0-c8": Case(lead=(0,)),
    "n5-c1": Case(lead=(5,), chunk=1, temperature=0.5),
    "n9-c100>N": Case(lead=(9,), chunk=100),
    "b2-t13-c5-T0.9": Case(lead=(2, 13), chunk=5, temperature=0.9),
    "n40-default-chunk-V300": Case(lead=(40,), vocab=300, chunk=None, temperature=0.8),
}


def _inputs(case, dtype=F64, scale=1.0):
    hidden = (torch.randn(*case.lead, case.hidden, dtype=F64) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(case.vocab, case.hidden, dtype=F64) * scale).to(dtype).requires_grad_()
    bias = torch.randn(case.vocab, dtype=F64).to(dtype).requires_grad_() if case.bias else None
    ids = torch.randint(0, case.vocab, case.lead)
    return hidden, weight, bias, ids


def _run(fn, hidden, weight, bias, ids, case, g_logp, g_entropy):
    """Outputs and gradients of sum(g_logp * logp + g_entropy * entropy); None for gradients not asked for."""
    logp, entropy = fn(hidden, weight, ids, bias=bias, temperature=case.temperature, return_entropy=True,
                       chunk_size=case.chunk)  # fmt: skip
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    grads = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_entropy).sum(), leaves, allow_unused=True)
    grads = list(grads) + [None] * (3 - len(grads))
    return [logp, entropy, *grads]


def _assert_close(name, got, want, atol, rtol=0.0):
    if want is None:
        assert got is None, name
        return
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if not got.numel():
        return
    diff = (got.to(F64) - want.to(F64)).abs()
    bound = atol + rtol * want.to(F64).abs()
    assert (diff <= bound).all(), f"{name}: max diff {diff.max():.3e}, mean {diff.mean():.3e}, atol {atol:.1e}"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_float64_matches_reference(case):
    hidden, weight, bias, ids = _inputs(case)
    g_logp, g_entropy = torch.randn(case.lead, dtype=F64), torch.randn(case.lead, dtype=F64)
    got = _run(selective_logprobs, hidden, weight, bias, ids, case, g_logp, g_entropy)
    want = _run(selective_logprobs_ref, hidden, weight, bias, ids, case, g_logp, g_entropy)
    assert got[0].dtype == F64 and got[1].dtype == F64 and got[0].shape == ids.shape
    for name, a, b in zip(NAMES, got, want):
        _assert_close(name, a, b, atol=1e-11)


@pytest.mark.parametrize("temperature", [1.0, 0.6], ids=["T1", "T0.6"])
def test_reference_matches_trl_selective_log_softmax(temperature):
    """The reference is TRL's math: logits / T, selective_log_softmax, entropy_from_logits (float64)."""
    case = Case(lead=(2, 11), temperature=temperature)
    hidden, weight, bias, ids = _inputs(case)
    logits = (hidden @ weight.T + bias) / temperature
    logp, entropy = selective_logprobs_ref(hidden, weight, ids, bias=bias, temperature=temperature, return_entropy=True)
    _assert_close("logp", logp, selective_log_softmax(logits, ids), atol=1e-12)
    _assert_close("entropy", entropy, entropy_from_logits(logits), atol=1e-12)


def test_matches_trl_fused_lm_head_function():
    """fp32 agreement with TRL 1.16's own chunked head (ChunkedLogProbFunction, torch path on CPU)."""
    from trl.kernels import ChunkedLogProbFunction

    case = Case(lead=(70,), hidden=16, vocab=97, temperature=0.7)
    hidden, weight, bias, ids = _inputs(case, dtype=torch.float32)
    g_logp, g_entropy = torch.randn(70), torch.randn(70)
    ours = _run(selective_logprobs, hidden, weight, bias, ids, case, g_logp, g_entropy)
    trl_logp, trl_entropy, *_ = ChunkedLogProbFunction.apply(
        hidden, weight, bias, ids, case.temperature, 32, None, 1.0, ("entropy",)
    )
    leaves = (hidden, weight, bias)
    trl = [trl_logp, trl_entropy, *torch.autograd.grad((trl_logp * g_logp + trl_entropy * g_entropy).sum(), leaves)]
    for name, a, b in zip(NAMES, ours, trl):
        _assert_close(name, a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("which", ["logp-only", "entropy-only", "entropy-unused"])
def test_partial_gradients(which):
    """Only the outputs that reach the loss contribute; an unused entropy output costs no gradient term."""
    case = Case(temperature=0.8)
    hidden, weight, bias, ids = _inputs(case)
    g = torch.randn(case.lead, dtype=F64)
    g_logp, g_entropy = {"logp-only": (g, 0 * g), "entropy-only": (0 * g, g), "entropy-unused": (g, 0 * g)}[which]
    want = _run(selective_logprobs_ref, hidden, weight, bias, ids, case, g_logp, g_entropy)
    logp, entropy = selective_logprobs(hidden, weight, ids, bias=bias, temperature=0.8, return_entropy=True,
                                       chunk_size=8)  # fmt: skip
    loss = {"logp-only": (logp * g).sum(), "entropy-only": (entropy * g).sum(), "entropy-unused": (logp * g).sum()}
    got = torch.autograd.grad(loss[which], (hidden, weight, bias))
    for name, a, b in zip(NAMES[2:], got, want[2:]):
        _assert_close(name, a, b, atol=1e-11)


def test_frozen_weight_int32_ids_no_entropy():
    """Only hidden needs a gradient (frozen head, e.g. LoRA); int32 ids; a single output."""
    case = Case(bias=False, temperature=1.2)
    hidden, weight, _, ids = _inputs(case)
    weight = weight.detach()
    logp = selective_logprobs(hidden, weight, ids.int(), temperature=1.2, chunk_size=8)
    want = selective_logprobs_ref(hidden, weight, ids, temperature=1.2)
    _assert_close("logp", logp, want, atol=1e-12)
    g = torch.randn(case.lead, dtype=F64)
    _assert_close(
        "d_hidden", torch.autograd.grad((logp * g).sum(), hidden)[0], torch.autograd.grad((want * g).sum(), hidden)[0],
        atol=1e-11,
    )  # fmt: skip


def test_autocast_does_not_lower_the_logits():
    """Under CPU bf16 autocast the tiles stay fp32: same outputs and gradients as without autocast."""
    case = Case(temperature=0.9)
    hidden, weight, bias, ids = _inputs(case, dtype=torch.float32)
    g_logp, g_entropy = torch.randn(case.lead), torch.randn(case.lead)
    plain = _run(selective_logprobs, hidden, weight, bias, ids, case, g_logp, g_entropy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = _run(selective_logprobs, hidden, weight, bias, ids, case, g_logp, g_entropy)
    for name, a, b in zip(NAMES, autocast, plain):
        assert a.dtype == b.dtype, name
        _assert_close(name, a, b, atol=0.0)


def test_gradcheck_tiny():
    case = Case(lead=(2, 3), hidden=4, vocab=7, chunk=4, temperature=0.7)
    hidden, weight, bias, ids = _inputs(case)

    def fn(h, w, b):
        return selective_logprobs(h, w, ids, bias=b, temperature=0.7, return_entropy=True, chunk_size=4)

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def _lowp_trl(hidden, weight, bias, ids, temperature):
    """TRL's non-fused path run entirely in the low dtype: logits in model dtype, / T, selective_log_softmax."""
    logits = (hidden @ weight.T + bias) / temperature
    return selective_log_softmax(logits, ids), entropy_from_logits(logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_within_twice_torch_error(dtype):
    """|kernel - ref64| <= 2 |torch_lowp - ref64| + atol for every output and gradient (same rounded inputs)."""
    case = Case(lead=(48,), hidden=64, vocab=300, chunk=16, temperature=0.7)
    hidden, weight, bias, ids = _inputs(case, dtype=dtype, scale=0.3)
    g_logp, g_entropy = torch.randn(case.lead), torch.randn(case.lead)
    got = _run(selective_logprobs, hidden, weight, bias, ids, case, g_logp, g_entropy)
    assert got[0].dtype == torch.float32 and got[2].dtype == dtype and got[3].dtype == dtype
    lowp_logp, lowp_entropy = _lowp_trl(hidden, weight, bias, ids, case.temperature)
    leaves = (hidden, weight, bias)
    lowp = [lowp_logp, lowp_entropy]
    lowp += torch.autograd.grad((lowp_logp * g_logp.to(dtype) + lowp_entropy * g_entropy.to(dtype)).sum(), leaves)
    ref_leaves = [t.detach().to(F64).requires_grad_() for t in leaves]
    want = _run(selective_logprobs_ref, *ref_leaves, ids, case, g_logp.to(F64), g_entropy.to(F64))
    # atol: one rounding of the value to the output dtype (fp32 outputs; grads stored in the input dtype)
    eps = torch.finfo(dtype).eps
    for name, a, lo, ref in zip(NAMES, got, lowp, want):
        torch_err = (lo.to(F64) - ref).abs()
        atol = (1e-6 if name in ("logp", "entropy") else eps) * ref.abs().max().item() + 1e-7
        bound = 2 * torch_err + atol
        err = (a.to(F64) - ref).abs()
        assert (err <= bound).all(), f"{name} {dtype}: max err {err.max():.3e} vs torch {torch_err.max():.3e}"


class _LargestVocabRows(TorchDispatchMode):
    """Records, over every aten op output with last dimension V, the most rows (views included: over-counts)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("fn", [selective_logprobs, selective_logprobs_ref], ids=["kernel", "reference"])
def test_no_tensor_with_vocab_columns_beyond_one_chunk(fn):
    """Forward + backward never create (and never save) a [rows > chunk, V] tensor; the reference does."""
    case, chunk = Case(lead=(256,), hidden=8, vocab=97), 16
    hidden, weight, bias, ids = _inputs(case, dtype=torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with _LargestVocabRows(case.vocab) as largest, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = fn(hidden, weight, ids, bias=bias, return_entropy=True, chunk_size=chunk)
        (logp.sum() + entropy.sum()).backward()
    inputs = {t.data_ptr() for t in (hidden, weight, bias)}
    big_saved = [tuple(t.shape) for t in saved if t.data_ptr() not in inputs and t.numel() > 256]
    if fn is selective_logprobs_ref:  # the tracker sees what it is meant to catch
        assert largest.rows >= 256 and big_saved
        return
    assert largest.rows <= chunk, f"a [{largest.rows}, V] tensor was created (chunk {chunk})"
    assert not big_saved, f"saved tensors beyond inputs and [N] vectors: {big_saved}"


def test_default_chunk_bounds_the_tile():
    assert default_chunk_size(201088) * 201088 * 4 <= 256 * 2**20
    assert default_chunk_size(201088) == 320 and default_chunk_size(2**30) == 1 and default_chunk_size(10) % 64 == 0


def test_weight_gathered_from_dtensor():
    """A DTensor head is refused by name; its gathered plain tensor works and the gradient reaches the shards."""
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group in this process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with tempfile.NamedTemporaryFile() as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous.name}", rank=0, world_size=1)
        try:
            case = Case(lead=(21,))
            hidden, weight, bias, ids = _inputs(case)
            sharded = distribute_tensor(weight.detach(), init_device_mesh("cpu", (1,)), [Shard(0)]).requires_grad_()
            with pytest.raises(ValueError, match="weight is a DTensor"):
                selective_logprobs(hidden, sharded, ids)
            selective_logprobs(hidden, sharded.full_tensor(), ids, bias=bias, chunk_size=8).sum().backward()
            selective_logprobs_ref(hidden, weight, ids, bias=bias).sum().backward()
            _assert_close("d_weight", sharded.grad.full_tensor(), weight.grad, atol=1e-11)
        finally:
            dist.destroy_process_group()


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.startswith(("mm", "addmm", "bmm"))
        return func(*args, **(kwargs or {}))


BAD = {
    "chunk-zero": ("chunk_size", dict(chunk_size=0)),
    "chunk-float": ("chunk_size", dict(chunk_size=8.0)),
    "chunk-bool": ("chunk_size", dict(chunk_size=True)),
    "temp-zero": ("temperature", dict(temperature=0.0)),
    "temp-negative": ("temperature", dict(temperature=-1.0)),
    "temp-inf": ("temperature", dict(temperature=float("inf"))),
    "temp-nan": ("temperature", dict(temperature=float("nan"))),
    "ids-negative": ("token_ids", dict(ids=-1)),
    "ids-equal-V": ("token_ids", dict(ids=50)),
    "ids-float": ("token_ids", dict(ids="float")),
    "ids-shape": ("token_ids", dict(ids="shape")),
    "weight-H": ("weight", dict(weight=(50, 11))),
    "weight-1d": ("weight", dict(weight=(50,))),
    "hidden-1d": ("hidden", dict(hidden=(12,))),
    "hidden-int": ("hidden", dict(hidden="int")),
    "bias-V": ("bias", dict(bias=49)),
}


@pytest.mark.parametrize("arg,change", BAD.values(), ids=BAD.keys())
def test_bad_input_names_the_argument_before_any_work(arg, change):
    case = Case()
    hidden, weight, bias, ids = (t.detach() if t is not None else t for t in _inputs(case))
    kwargs = {"bias": bias, "chunk_size": 8}
    if "ids" in change:
        v = change["ids"]
        ids = ids.double() if v == "float" else ids[:-1] if v == "shape" else ids.clone().fill_(v)
    if "weight" in change:
        weight = torch.randn(change["weight"], dtype=F64)
    if "hidden" in change:
        hidden = hidden.long() if change["hidden"] == "int" else torch.randn(change["hidden"], dtype=F64)
    if "bias" in change:
        kwargs["bias"] = torch.randn(change["bias"], dtype=F64)
    kwargs.update({k: v for k, v in change.items() if k in ("chunk_size", "temperature")})
    for fn in (selective_logprobs, selective_logprobs_ref):
        with _CountMatmuls() as matmuls, pytest.raises(ValueError, match=arg):
            fn(hidden, weight, ids, **kwargs)
        assert matmuls.count == 0
