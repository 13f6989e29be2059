"""Small real virtualenvs for the server-environment tests: created by ``python -m venv --without-pip`` (about a
second), with distributions declared by their ``.dist-info`` metadata, which is all that the code under test reads
(``importlib.metadata`` in the environment's own interpreter). No package is downloaded."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
from pathlib import Path


def make_venv(path: Path) -> Path:
    """A virtualenv at ``path`` without pip or any package; returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=300)
    return path / "bin" / "python"


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def declare(site: Path, name: str, version: str, files: dict[str, bytes] | None = None) -> None:
    """Install distribution ``name`` ``version`` into ``site`` as metadata, with ``files`` (relative path ->
    content) listed in its RECORD and written to disk (a later ``declare`` of the same path overwrites it, as a
    later ``pip install`` does)."""
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for relative, data in (files or {}).items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_bytes(data)
        lines.append(f"{relative},{record_hash(data)},{len(data)}")
    lines.append(f"{dist_info.name}/METADATA,,")
    (dist_info / "RECORD").write_text("\n".join(lines) + "\n")
