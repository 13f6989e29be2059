"""``prepare_context_parallel(None, model, plugin)`` on several processes with an unwrapped module must refuse:
nothing would sum the per-rank partial gradients of the sharded backward (issue 13)."""

from __future__ import annotations

import pytest

from trl_gptoss.testing.distributed import launch

pytestmark = pytest.mark.distributed


def unwrapped_worker(rank, world):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trl_gptoss.parallel import ContextParallelPlugin, prepare_context_parallel
    from trl_gptoss.testing import tiny_gpt_oss

    torch.manual_seed(0)
    model = tiny_gpt_oss().float()
    report = {}
    try:
        prepare_context_parallel(None, model, ContextParallelPlugin(sp_size=world))
        report["unwrapped"] = None
    except ValueError as error:
        report["unwrapped"] = str(error)
    runner = prepare_context_parallel(None, DistributedDataParallel(model), ContextParallelPlugin(sp_size=world))
    report["wrapped"] = type(runner).__name__
    dist.barrier()  # every rank got here: the refusal left no peer blocked in a collective
    return report


def test_unwrapped_module_on_two_processes_is_refused_on_every_rank(tmp_path):
    for rank, report in enumerate(launch(unwrapped_worker, 2, tmp_path, timeout=240)):
        assert report["unwrapped"] is not None, f"rank {rank}: an unwrapped module was accepted"
        assert "unwrapped" in report["unwrapped"] and "DistributedDataParallel" in report["unwrapped"]
        assert report["wrapped"] == "ContextParallelRunner"
