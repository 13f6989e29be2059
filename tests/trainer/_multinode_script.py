"""One FSDP2 training step of a tiny GPT-OSS, run by ``accelerate launch`` on each "machine" of
``test_multinode_launch.py``: ``_multinode_script.py OUT_DIR MACHINE_RANK [flags]`` writes
``machine{MACHINE_RANK}.json`` (what accelerate made of the launch) to ``OUT_DIR``.

``--cpu-accelerator``: ``Accelerator(cpu=True)`` (what ``TrainingArguments(use_cpu=True)`` passes), so accelerate
adopts torchrun's world as ``MULTI_CPU`` on gloo. ``--fsdp2-on-cpu``: create it under
``trl_gptoss.testing.fsdp_cpu.fsdp2_on_cpu`` (the tests' CPU shim, docs/testing.md), so the FSDP plugin
accelerate built from the launch's YAML survives on a CPU host.
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.tensor import DTensor

from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.testing.fsdp_cpu import fsdp2_on_cpu


def main(out_dir: str, machine: int, cpu: bool, shim: bool) -> None:
    with fsdp2_on_cpu() if shim else contextlib.nullcontext():
        accelerator = Accelerator(cpu=cpu)
    world = torch.tensor([1.0])
    if dist.is_initialized():
        dist.all_reduce(world)  # the process group the launch built, whatever accelerate made of it
    model = tiny_gpt_oss(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = int(os.environ.get("RANK", accelerator.process_index))
    ids = torch.arange(16).add(17 * rank).remainder(500).add(9)[None]  # a different row per machine
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    params = list(model.parameters())
    result = {
        "rank": rank,
        "machine_rank": machine,
        "group_rank": os.environ.get("GROUP_RANK"),  # torchrun's node rank
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        "process_group": dist.is_initialized(),
        "process_group_size": int(world.item()),
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "is_fsdp2": bool(getattr(accelerator, "is_fsdp2", False)),
        "dtensor": all(isinstance(p, DTensor) for p in params),
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "full_numel": sum(p.numel() for p in params),
        "loss": float(loss.detach()),
    }
    Path(out_dir, f"machine{result['machine_rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--cpu-accelerator" in sys.argv, "--fsdp2-on-cpu" in sys.argv)
