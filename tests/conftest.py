"""Suite-wide settings: deterministic, offline, CPU by default."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads this once, at import: set it before any test module imports gptoss_kernels.triton, so a plain
# `pytest` run proves the kernels on the CPU too. A CUDA host runs the compiled kernels instead.
if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "" and os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "0")
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# A tiny GPT-OSS served by a real vLLM engine, shared by every test of one pytest worker. Tests that use it
# carry `pytest.mark.xdist_group("vllm")` so that xdist sends them all to one worker: one server per run.
TINY_SERVED_OVERRIDES = dict(initializer_range=0.15)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from trl_gptoss.testing import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gpt-oss"), seed=0, **TINY_SERVED_OVERRIDES)


@pytest.fixture(scope="session")
def vllm_tiny_server(tiny_checkpoint):
    from trl_gptoss.testing import vllm_server

    with vllm_server(tiny_checkpoint, max_model_len=1024) as server:
        yield server


# The taught tiny GPT-OSS over the real o200k vocabulary (tests/recipes/taught.py): taught once per pytest worker,
# used by the rehearsals and by `trl-gptoss eval`'s end-to-end test. Tests that use it carry
# `pytest.mark.xdist_group("rehearsals")`, so that xdist sends them to one worker: one teaching per run.
@pytest.fixture(scope="session")
def o200k_tokenizer():
    from trl_gptoss.testing import harmony_tokenizer

    return harmony_tokenizer()


@pytest.fixture(scope="session")
def taught_policy(o200k_tokenizer):
    """The taught model (fp32) and, per taught prompt, the odds that it earns the higher reward."""
    from tests.recipes.taught import answer_odds, teach

    model, loss = teach(o200k_tokenizer)
    odds = answer_odds(model, o200k_tokenizer)
    assert all(0.2 <= p <= 0.8 for p in odds.values()), f"teaching did not reach ~50/50 answers (loss {loss}): {odds}"
    return model, odds


@pytest.fixture(scope="session")
def taught_checkpoint(taught_policy, o200k_tokenizer, tmp_path_factory):
    """``checkpoint(dtype)``: the taught model saved (safetensors, plus the o200k tokenizer) in ``dtype``, the way a
    recipe's converted checkpoint is stored (``/models/gpt-oss-20b-bf16``); one directory per dtype."""
    import copy

    model, _ = taught_policy
    saved = {}

    def checkpoint(dtype: str):
        if dtype not in saved:
            path = tmp_path_factory.mktemp(f"taught-{dtype}")
            copy.deepcopy(model).to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
            o200k_tokenizer.save_pretrained(path)
            saved[dtype] = path
        return saved[dtype]

    return checkpoint
