"""GPU weight push over the process-group transport: a pushed server equals a fresh one.

Needs CUDA and the server's environment (``trl-gptoss setup-server``); skipped elsewhere (never run on the CPU-only
CI machine). On one GPU the trainer and the server share the device, which NCCL refuses, so the push runs over
gloo (``backend_for``); with the server on another GPU it runs over NCCL. Both are checked by what they deliver.
"""

import pytest
import torch

from trl_gptoss.rollout import VLLMServer, VLLMServerEngine
from trl_gptoss.rollout.weights.group_push import GroupWeightPusher
from trl_gptoss.testing import save_tiny_checkpoint, tiny_gpt_oss

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.xdist_group("vllm")]

SEQUENCE = list(range(5, 45))


def _scores(engine) -> torch.Tensor:
    return torch.tensor(engine.score(SEQUENCE))


def test_group_push_of_every_group_equals_a_fresh_server(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = tiny_gpt_oss(seed=0, initializer_range=0.15)
    trained = tiny_gpt_oss(seed=0, initializer_range=0.15)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every parameter moves: sinks, experts, router, attention, embeddings, norms, head
        for param in trained.parameters():
            param.add_(0.3 * max(float(param.std()), 0.1) * torch.randn(param.shape, generator=generator))
    save_tiny_checkpoint(tmp_path / "base", base)
    save_tiny_checkpoint(tmp_path / "trained", trained)
    with VLLMServer(tmp_path / "trained", device="cuda", dtype="float32", max_model_len=256) as server:
        fresh = _scores(VLLMServerEngine(server.base_url))
    with VLLMServer(tmp_path / "base", device="cuda", dtype="float32", max_model_len=256) as server:
        engine = VLLMServerEngine(server.base_url)
        before = _scores(engine)
        engine.push_weights(trained.cuda())
        pusher = engine._weight_sync
        assert isinstance(pusher, GroupWeightPusher)
        print(f"group push on one GPU: backend {pusher.backend}, {pusher.last_push}")
        after = _scores(engine)
        engine.close()
    assert (before - fresh).abs().max() > 1e-2
    assert (after - fresh).abs().max() <= 1e-4, (after - fresh).abs().max()
