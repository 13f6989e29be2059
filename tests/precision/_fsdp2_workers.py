"""Code run inside the spawned gloo ranks of the precision matrix (importable by ``spawn``): every FSDP2 cell,
one after another, in one two-rank world (accelerate's FSDP2 preparation through ``trl_gptoss.testing.fsdp_cpu``).

A cell that raises records its traceback and the world moves on to the next cell; both ranks run the same
cells in the same order, so a cell that fails on one rank only would desynchronise the collectives of the next
ones -- the per-cell results say which cell failed first.
"""

from __future__ import annotations

import os
import traceback

from trl_gptoss.testing.distributed import set_rank_environment


def prepare_like_accelerate(accelerator):
    """A function that shards a model as accelerate's FSDP2 preparation sharded the trainer's (same plugin: wrap
    policy, mixed precision policy, fp32 upcast of trainable low-precision parameters under mixed precision)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    def prepare(model):
        accelerator.state.fsdp_plugin.set_auto_wrap_policy(model)
        return fsdp2_prepare_model(accelerator, model)

    return prepare


def mixed_precision_of(trainer) -> dict:
    """What FSDP2 mixed precision the trainer's accelerator applies: accelerate's mode and the plugin's policy."""
    plugin = trainer.accelerator.state.fsdp_plugin
    policy = plugin.mixed_precision_policy
    return {
        "mixed_precision": trainer.accelerator.mixed_precision,
        "param_dtype": None if policy is None else str(policy.param_dtype).removeprefix("torch."),
        "reduce_dtype": None if policy is None else str(policy.reduce_dtype).removeprefix("torch."),
        "output_dtype": None if policy is None else str(policy.output_dtype).removeprefix("torch."),
    }


def matrix_rank(rank: int, world: int, cells: list[dict], output_dir: str) -> dict:
    """Run ``cells`` (``Cell`` fields) as FSDP2 cells; per cell id: ``run_cell``'s result or ``{"error": ...}``."""
    set_rank_environment(rank, world)
    from tests.precision.matrix import Cell, run_cell
    from trl_gptoss.testing import harmony_tokenizer
    from trl_gptoss.testing.fsdp_cpu import fsdp2_on_cpu

    tokenizer = harmony_tokenizer(small=True)
    results = {}
    for fields in cells:
        cell = Cell(**fields)
        try:
            with fsdp2_on_cpu():
                result = run_cell(
                    cell,
                    os.path.join(output_dir, cell.id),
                    tokenizer,
                    num_processes=world,
                    prepare=prepare_like_accelerate,
                    describe=mixed_precision_of,
                )
        except Exception:  # noqa: BLE001  (reported per cell; the parent test fails that cell)
            result = {"error": traceback.format_exc()}
        results[cell.id] = result
    return results
