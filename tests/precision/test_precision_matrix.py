"""The precision matrix (issue 27, STYLE.md #19): every precision setup a recipe implies runs one real GRPO step
through ``fa3_sink``, ``gptoss_sequential`` and ``selective_logprobs``, and its loss pass matches stock
transformers within stock's own error.

weights {fp32, bf16} x autocast {off, bf16, fp16} x LoRA {none, q/k/v/o + both expert parameters} x {one
process, FSDP2 over two gloo ranks}. Per cell (``tests/precision/matrix.py`` says how):

- it runs: the step's loss and the loss pass's loss are finite, every trainable tensor moved (LoRA A excepted:
  PEFT starts B at zero, so A's first gradient is exactly zero);
- dtypes: trainable parameters are fp32 where fp32 masters are promised (fp32 weights under autocast, LoRA
  adapters over a bf16 base, FSDP2 mixed precision's upcast) and the loaded dtype otherwise; every gradient is
  in its parameter's dtype;
- numbers: ``|ours - ref64| <= 2 |stock - ref64| + atol`` for the loss-pass log-probs, the loss and every
  trainable parameter's gradient (sinks, router, experts, LoRA A/B), routes pinned to ref64's.

fp32 weights + ``bf16: true`` is TRL's default ``GRPOConfig``: before the experts op followed autocast (b64d434)
its first step raised "routing_weights has dtype torch.bfloat16 but hidden_states has torch.float32", with and
without LoRA. fp16 has no recipe (all ship bf16) and accelerate enables fp16 autocast only off the CPU: the
one-process fp16 cells emulate it (``matrix._fp16_autocast``), the FSDP2 ones are skipped. (The job refuses
``fp16: true`` over bf16 weights before loading; the bf16 x fp16 cells hold for the trainer API it wraps.)

The FSDP2 cells all run in one two-rank world per pytest run (``fsdp2_world``).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict

import pytest

from tests.precision._fsdp2_workers import matrix_rank
from tests.precision.matrix import WEIGHTS, Cell, all_cells, run_cell
from trl_gptoss.testing.distributed import WorldFailed, launch

WORLD = 2
FSDP2_FP16 = (
    "no recipe trains in fp16 (every shipped YAML is bf16), and accelerate 1.15 turns fp16 autocast on only off "
    "the CPU; fp16 is covered by the one-process cells"
)
SHIM_WITHOUT_MIXED_PRECISION = (
    "FSDP2 mixed precision needs accelerate's MixedPrecisionPolicy (param_dtype=bf16), which "
    "trl_gptoss.testing.fsdp_cpu applies on the CPU (fsdp_plugin.set_mixed_precision); without it the bf16 cell "
    "would check fp32 masters and bf16 autocast with parameters all-gathered in fp32, not what a recipe runs"
)


def _expected_param_dtype(cell: Cell, name: str, facts: dict) -> str:
    if "lora_" in name:
        return "float32"  # PEFT creates adapters in fp32 over any base (autocast_adapter_dtype)
    if cell.layout == "fsdp2" and facts["mixed_precision"] != "no":
        return "float32"  # accelerate's FSDP2 preparation upcasts trainable parameters to fp32 masters
    return str(WEIGHTS[cell.weights]).removeprefix("torch.")


def _check(cell: Cell, result: dict) -> None:
    step, facts = result["step"], result["facts"]
    assert step["losses"] and all(math.isfinite(x) for x in step["losses"]), step["losses"]
    assert math.isfinite(result["loss_pass"]["loss"]), result["loss_pass"]["loss"]
    if cell.lora:
        names = list(step["moved"])
        assert all("lora_" in n for n in names), names
        assert any("self_attn.q_proj" in n for n in names) and any("mlp.experts" in n for n in names), names
    still = [n for n, moved in step["moved"].items() if not moved and "lora_A" not in n]
    assert not still, f"trainable tensors that did not move in one step: {still}"
    wrong = {
        n: (dtype, _expected_param_dtype(cell, n, facts))
        for n, dtype in step["param_dtypes"].items()
        if dtype != _expected_param_dtype(cell, n, facts)
    }
    assert not wrong, f"parameter dtypes after the step (got, expected): {wrong}"
    if cell.layout == "fsdp2":  # FSDP2's output_dtype=bf16 would cast them (trainer/fsdp_precision.py)
        assert facts["logp_dtype"] == "float32", f"the loss pass's log-probs left the model in {facts['logp_dtype']}"
    grads = {n: d for n, d in result["loss_pass"]["dtypes"].items() if d[1] != d[0]}
    assert not grads, f"gradients not in their parameter's dtype (param, grad): {grads}"
    failed = [_describe(name, q) for name, q in result["compare"].items() if not q["ok"]]
    assert not failed, f"{cell.id}: {len(failed)} of {len(result['compare'])} quantities off:\n" + "\n".join(failed)


def _describe(name: str, q: dict) -> str:
    if "missing" in q:
        return f"{name}: no gradient (ours, stock, ref64 missing: {q['missing']})"
    return (
        f"{name}: ours {q['ours']:.3e} (mean {q['mean_ours']:.3e}) > 2 x stock {q['stock']:.3e} + atol {q['atol']:.3e}"
    )


@pytest.fixture(scope="module")
def tokenizer():
    from trl_gptoss.testing import harmony_tokenizer

    return harmony_tokenizer(small=True)


SINGLE = all_cells("single")


@pytest.mark.parametrize("cell", SINGLE, ids=[c.id for c in SINGLE])
def test_one_process(cell, tokenizer, tmp_path):
    _check(cell, run_cell(cell, str(tmp_path), tokenizer))


@pytest.fixture(scope="module")
def fsdp2_world(tmp_path_factory) -> list[dict]:
    """Every FSDP2 cell that runs, in one two-rank world: per rank, cell id -> result.

    One world per pytest run even when xdist splits these tests over workers: pytest-xdist 3.8's loadgroup
    does not group on pytest 9.2 (it renames ``item._nodeid``, which pytest 9.2 no longer reads; pytest-xdist
    issue 1386), so the first worker runs the world under a lock in the run's shared temp directory and the
    others read its results.
    """
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's basetemp, above every worker's own
    results = shared / "precision-fsdp2.json"
    with FileLock(str(shared / "precision-fsdp2.lock")):
        if not results.exists():
            run = shared / "precision-fsdp2"
            cells = [asdict(c) for c in all_cells("fsdp2") if c.autocast != "fp16"]
            ranks = _run_world(run, cells)
            results.write_text(json.dumps(ranks))
    ranks = json.loads(results.read_text())
    if "launch_error" in ranks:
        pytest.fail(f"the FSDP2 world failed:\n{ranks['launch_error']}")
    return ranks


def _run_world(run, cells: list[dict]) -> list[dict] | dict:
    """Per-rank results, or ``{"launch_error": ...}`` (every cell fails with it). A world in which a rank died
    without a traceback (the host's OOM killer, a segfault) runs once more in a fresh directory, and the
    first death is reported as a warning: a crash of ours repeats, a kill from outside (the CI host runs other
    suites beside this one) rarely does."""

    def attempt(name: str) -> list[dict]:
        return launch(matrix_rank, WORLD, run / name, cells, str(run / name / "out"), timeout=600)

    try:
        try:
            return attempt("first")
        except WorldFailed as error:
            if not error.signalled:
                raise
            warnings.warn(f"the FSDP2 world died by a signal; running it again:\n{error}", stacklevel=1)
        return attempt("second")
    except WorldFailed as error:
        return {"launch_error": str(error)}


FSDP2 = [
    pytest.param(c, id=c.id, marks=[pytest.mark.skip(reason=FSDP2_FP16)] if c.autocast == "fp16" else [])
    for c in all_cells("fsdp2")
]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("precision_fsdp2")
@pytest.mark.parametrize("cell", FSDP2)
def test_fsdp2(cell, fsdp2_world):
    results = [rank[cell.id] for rank in fsdp2_world]
    for rank, result in enumerate(results):
        if "error" in result:
            pytest.fail(f"{cell.id} raised on rank {rank}:\n{result['error']}")
    if cell.autocast == "bf16":  # a shim that stopped applying the policy fails here, never skips
        applied = [r["facts"]["param_dtype"] for r in results]
        assert applied == ["bfloat16"] * WORLD, f"{SHIM_WITHOUT_MIXED_PRECISION}; per rank: {applied}"
    for result in results:
        _check(cell, result)
