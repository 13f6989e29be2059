"""The multi-node YAML's launch line on one host: two "machines" (``--machine_rank 0`` and ``1``, one process
each, ``--main_process_ip 127.0.0.1``) started as two background ``accelerate launch`` processes.

What accelerate 1.15 makes of it on a CPU host (no accelerator), each case asserted below:

- the line as shipped: ``distributed_type: FSDP`` launches through torchrun (``multi_gpu_launcher``), whose
  c10d rendezvous joins both machines (one gloo group of 2, ``GROUP_RANK`` 0/1), but ``AcceleratorState``
  picks a distributed type only for accelerator backends: each process sees ``DistributedType.NO``,
  ``num_processes == 1``, ``process_index == 0`` -- two unsynchronised full copies, both "main". So the line
  is a GPU line; on a CPU host it must not be used to train.
- ``--cpu`` added: accelerate's ``simple_launcher`` (no torchrun): no rendezvous at all, each machine runs
  alone (its CPU multi-node path expects an MPI launcher).
- the line as shipped, with the script creating ``Accelerator(cpu=True)`` under the tests' FSDP2 shim
  (``fsdp2_on_cpu``): accelerate adopts torchrun's world (``MULTI_CPU`` -> ``FSDP``), prepares the model with
  ``fully_shard`` across the two machines, and one training step finishes on both.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
YAML = ROOT / "examples" / "configs" / "accelerate_fsdp2_multinode.yaml"
SCRIPT = Path(__file__).with_name("_multinode_script.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_two_machines(out: Path, launch_flags=(), script_flags=(), timeout: float = 240) -> list[dict]:
    """Run the YAML's launch line once per machine rank, concurrently; every launch must exit 0."""
    out.mkdir(parents=True)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(YAML)]
    procs = []
    for machine in range(2):
        command = [
            *accelerate,
            *["--num_machines", "2", "--machine_rank", str(machine), "--num_processes", "2"],
            *["--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *launch_flags],
            str(SCRIPT),
            *[str(out), str(machine), *script_flags],
        ]
        log = open(out / f"launch{machine}.log", "wb")  # noqa: SIM115 (closed below, after the wait)
        procs.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [proc.wait(timeout=timeout) for proc, _ in procs]
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    logs = "\n".join((out / f"launch{m}.log").read_text()[-3000:] for m in range(2))
    assert codes == [0, 0], f"exit codes {codes}:\n{logs}"
    return [json.loads((out / f"machine{m}.json").read_text()) for m in range(2)]


def test_the_yaml_line_rendezvous_on_cpu_but_accelerate_sees_one_process_per_machine(tmp_path):
    machines = _launch_two_machines(tmp_path / "run")
    assert [m["group_rank"] for m in machines] == ["0", "1"] and [m["rank"] for m in machines] == [0, 1]
    assert all(m["world_size"] == 2 and m["process_group_size"] == 2 for m in machines), "no rendezvous"
    for machine in machines:  # the silent degradation the module docstring describes
        assert machine["distributed_type"] == "DistributedType.NO", machine
        assert machine["num_processes"] == 1 and machine["process_index"] == 0 and not machine["dtensor"]


def test_the_yaml_line_with_cpu_flag_starts_each_machine_alone(tmp_path):
    machines = _launch_two_machines(tmp_path / "run", launch_flags=["--cpu"])
    for machine in machines:
        assert not machine["process_group"] and machine["group_rank"] is None, machine
        assert machine["distributed_type"] == "DistributedType.NO" and machine["num_processes"] == 1


def test_the_yaml_line_trains_fsdp2_across_two_machines_with_a_cpu_accelerator(tmp_path):
    flags = ["--cpu-accelerator", "--fsdp2-on-cpu"]
    machines = _launch_two_machines(tmp_path / "run", script_flags=flags)
    assert [m["process_index"] for m in machines] == [0, 1] and [m["group_rank"] for m in machines] == ["0", "1"]
    for machine in machines:
        assert machine["distributed_type"] == "DistributedType.FSDP" and machine["is_fsdp2"], machine
        assert machine["num_processes"] == 2 and machine["process_group_size"] == 2
        assert machine["dtensor"] and machine["local_numel"] < machine["full_numel"], "not sharded across machines"
    assert machines[0]["loss"] != machines[1]["loss"]  # each machine trained on its own row
