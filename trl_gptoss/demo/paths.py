"""Where the packaged embedded-default config lives (``examples/configs/retool_cpu_demo.yaml`` links to it)."""

from __future__ import annotations

from pathlib import Path


def embedded_default_config() -> Path:
    """The YAML ``make demo`` / ``trl-gptoss demo`` run (shipped inside the package)."""
    return Path(__file__).with_name("retool_cpu_demo.yaml")
