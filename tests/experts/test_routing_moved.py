"""``trl_gptoss.routing`` moved to ``trl_gptoss.experts.routing``: the old path still works, with a warning."""

import importlib
import subprocess
import sys

import pytest

from trl_gptoss.experts import routing

NAMES = ["FORMAT_VERSION", "RoutingRecord", "compact_index_dtype", "record_routing", "replay_routing"]


def test_old_import_path_warns_and_gives_the_same_objects():
    sys.modules.pop("trl_gptoss.routing", None)
    with pytest.warns(DeprecationWarning, match=r"trl_gptoss\.routing moved to trl_gptoss\.experts\.routing"):
        old = importlib.import_module("trl_gptoss.routing")
    for name in NAMES:
        assert getattr(old, name) is getattr(routing, name), name


def test_importing_the_experts_package_leaves_routing_unloaded():
    """``trl_gptoss.experts`` is imported when transformers loads GPT-OSS (registration): routing is opt-in."""
    code = "import sys, trl_gptoss.experts; print('trl_gptoss.experts.routing' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "False"
