"""``import trl_gptoss`` stays light, yet transformers finds ``fa3_sink`` and ``gptoss_sequential``; and the trainer
never imports vLLM (not installed in its environment, not imported by any module outside the worker extension).

Every import check runs in a fresh interpreter: what is imported, and in which order, is the thing under test.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LIGHT_PACKAGES = ["rewards", "harmony", "tools", "data"]
HEAVY_MODULES = ("torch", "transformers", "datasets")


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("package", LIGHT_PACKAGES)
def test_light_packages_import_without_torch(package):
    out = _run(f"""
        import sys
        import trl_gptoss.{package}
        print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))
    """)
    assert out.strip() == "[]", f"import trl_gptoss.{package} pulled in {out.strip()}"


# Build a tiny GPT-OSS with both implementations and check they are the real ones: logits equal eager's, and
# the experts raise this package's error for an out-of-range expert id. The import order comes first.
_BUILD_AND_CHECK = """
import copy
import sys
import torch
import transformers
from transformers import GptOssConfig, GptOssForCausalLM

config = GptOssConfig(
    vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
)
torch.manual_seed(0)
build = lambda **impl: GptOssForCausalLM._from_config(copy.deepcopy(config), **impl)  # each its own config
ours = build(attn_implementation="fa3_sink", experts_implementation="gptoss_sequential")
eager = build(attn_implementation="eager", experts_implementation="eager")
assert (ours.config._attn_implementation, ours.config._experts_implementation) == ("fa3_sink", "gptoss_sequential")
eager.load_state_dict(ours.state_dict())
ids = torch.randint(0, 64, (2, 9))
with torch.no_grad():
    diff = (ours(ids).logits - eager(ids).logits).abs().max().item()
assert diff < 1e-5, diff
try:
    ours.model.layers[0].mlp.experts(torch.zeros(3, 32), torch.full((3, 2), 4), torch.ones(3, 2))
except ValueError as error:
    assert "router_indices must lie in [0, 4)" in str(error), error
else:
    raise AssertionError("the experts did not go through gptoss_sequential")
assert not [f for f in sys.meta_path if type(f).__name__ == "_Watcher"], "the import watcher was not removed"
print("ok")
"""

IMPORT_ORDERS = {
    "package_then_transformers": "import trl_gptoss",
    "attention_package_first": "import trl_gptoss.attention",  # it pulls transformers in while half-imported
    "experts_package_first": "import trl_gptoss.experts",
    "transformers_then_package": "import transformers.models.gpt_oss.modeling_gpt_oss\nimport trl_gptoss",
}


@pytest.mark.parametrize("order", list(IMPORT_ORDERS))
def test_transformers_finds_both_implementations(order):
    assert _run(IMPORT_ORDERS[order] + "\n" + _BUILD_AND_CHECK).strip() == "ok"


def test_a_failed_registration_warns_and_leaves_transformers_usable():
    out = _run("""
        import sys, warnings
        sys.modules["gptoss_kernels"] = None  # a broken kernels install: trl_gptoss.attention cannot import
        import trl_gptoss
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from transformers import AttentionInterface, GptOssForCausalLM  # noqa: F401
        print([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)])
        print("fa3_sink" in AttentionInterface._global_mapping)
    """)
    messages, registered = out.strip().splitlines()
    assert "could not register trl_gptoss.attention with transformers" in messages and registered == "False"


# The trainer never imports vLLM: vLLM lives in the rollout server's own environment (every release pins a
# transformers older than ours), and only the worker extension, which runs inside vLLM, may import it.
WORKER_PACKAGE = ("trl_gptoss", "rollout", "vllm_worker")


def test_the_training_environment_cannot_import_vllm():
    proc = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, f"vLLM is importable in the training environment ({sys.prefix})"
    assert "No module named 'vllm'" in proc.stderr, proc.stderr[-2000:]


def _vllm_imports(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that import vllm: ``import``/``from`` statements at any depth (inside functions too), and
    ``importlib.import_module("vllm...")`` / ``__import__("vllm...")`` calls with a literal name."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
            first = node.args[0]
            names = [first.value] if isinstance(first, ast.Constant) and isinstance(first.value, str) else []
        else:
            continue
        if any(name == "vllm" or name.startswith("vllm.") for name in names):
            lines.append(node.lineno)
    return lines


def _is_import_call(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id == "__import__") or (
        isinstance(func, ast.Attribute) and func.attr == "import_module"
    )


def test_the_scan_finds_every_form_of_a_vllm_import():
    code = textwrap.dedent("""
        import vllm
        from vllm.distributed import x
        def push():
            import vllm.utils as u
            importlib.import_module("vllm.distributed.weight_transfer")
            return __import__("vllm")
        from .vllm import relative_is_ours
        import vllm_like
        importlib.util.find_spec("vllm")
    """)
    assert _vllm_imports(ast.parse(code)) == [2, 3, 5, 6, 7]


def test_nothing_outside_the_worker_extension_imports_vllm():
    import gptoss_kernels
    import trl_gptoss

    offenders = []
    for package in (trl_gptoss, gptoss_kernels):
        root = Path(package.__file__).resolve().parent
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root.parent)
            if relative.parts[:3] != WORKER_PACKAGE:
                offenders += [f"{relative}:{line}" for line in _vllm_imports(ast.parse(path.read_text()))]
    assert offenders == [], f"vLLM imported outside rollout/vllm_worker/: {offenders}"
