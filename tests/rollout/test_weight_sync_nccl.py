"""The GPU push's control flow on the CPU: the calls one push makes, and what a failure mid-push leaves behind.

NCCL and a GPU vLLM server cannot run here, so the server is a recording stand-in that answers the HTTP calls
``NCCLWeightPusher`` makes, and the transfer group one that records broadcasts and can fail. The tensors come
from a real tiny GPT-OSS through the real ``push_model`` driver. The end-to-end check on a GPU is
``test_weight_sync_gpu.py``.
"""

import pytest
import torch

from trl_gptoss.rollout.vllm_engine import VLLMServerError
from trl_gptoss.rollout.vllm_worker.gptoss_vllm_worker import loads_directly
from trl_gptoss.rollout.weights import push_model
from trl_gptoss.rollout.weights.nccl_push import NCCLTransferError, NCCLWeightPusher
from trl_gptoss.rollout.weights.push import pushed_layout
from trl_gptoss.testing import tiny_gpt_oss


class RecordingServer:
    """Answers what a vLLM server answers; ``fail`` maps a call to the error it raises (once)."""

    base_url = "http://gpu-server:8000"

    def __init__(self, fail=None, reset_success=True):
        self.calls, self.fail, self.reset_success = [], dict(fail or {}), reset_success

    def request(self, method, path, payload=None, *, timeout=None, retries=None):
        call = path if path != "/collective_rpc" else payload["method"]
        self.calls.append((call, retries))
        if call in self.fail:
            raise self.fail.pop(call)
        if call == "/reset_prefix_cache":
            return {"success": self.reset_success}
        if call == "gptoss_receive_direct_nccl":
            return {"results": [{"direct": []}]}
        return None


class RecordingGroup:
    """A transfer group that records each broadcast (names, dtypes) and can fail on the n-th one."""

    def __init__(self, fail_at=None):
        self.broadcasts, self.fail_at, self.closed = [], fail_at, False

    def broadcast(self, named):
        if self.fail_at is not None and len(self.broadcasts) == self.fail_at:
            raise RuntimeError("NCCL error: remote process exited")
        self.broadcasts.append([(n, t.dtype) for n, t in named])

    def close(self):
        self.closed = True


def pusher_for(model, server, group, dtype="bfloat16"):
    return NCCLWeightPusher(
        server, {"layout": pushed_layout(model), "dtype": dtype}, make_group=lambda: group, device="cpu"
    )


def test_one_push_is_one_reload_session_then_one_direct_pass_in_the_server_dtype():
    model = tiny_gpt_oss(seed=0)  # float32 master weights
    server, group = RecordingServer(), RecordingGroup()
    push_model(lambda: [pusher_for(model, server, group)], model)
    calls = [c for c, _ in server.calls]
    layers = 4  # embeddings, layer 0, layer 1, norm + head
    assert calls == (
        ["/pause?mode=wait", "/start_weight_update"]
        + ["/update_weights"] * layers
        + ["/finish_weight_update"]
        + ["gptoss_receive_direct_nccl"] * 2  # sinks and experts live in the two decoder layers
        + ["/reset_prefix_cache", "/resume"]
    )
    coupled = [r for c, r in server.calls if c in ("/update_weights", "gptoss_receive_direct_nccl")]
    assert coupled and set(coupled) == {0}, "a call coupled to a broadcast must never be retried"
    sent = [name for b in group.broadcasts for name, _ in b]
    assert sorted(sent) == sorted(pushed_layout(model)) and len(sent) == len(set(sent))
    reload_names = [name for b in group.broadcasts[:layers] for name, _ in b]
    assert not any(loads_directly(n) for n in reload_names)  # sinks and experts only in the direct pass
    assert {d for b in group.broadcasts for _, d in b} == {torch.bfloat16}  # cast to the server's dtype


@pytest.mark.parametrize("at", [0, 3, 5], ids=["first-reload", "last-reload", "direct"])
def test_a_broadcast_failing_mid_push_tears_the_group_down_and_names_the_call(at):
    model = tiny_gpt_oss(seed=0)
    server, group = RecordingServer(), RecordingGroup(fail_at=at)
    pusher = pusher_for(model, server, group)
    call = "gptoss_receive_direct_nccl" if at >= 4 else "/update_weights"
    with pytest.raises(NCCLTransferError, match=rf"gpu-server:8000: {call} failed .*torn down"):
        push_model(lambda: [pusher], model)
    assert group.closed and pusher.group is None
    calls = [c for c, _ in server.calls]
    # the open session is closed, the server's end released, generation resumed; nothing after the failure
    tail = ["/shutdown_weight_transfer_engine", "/resume"]
    assert calls[-2:] == tail and calls[-3] == ("/finish_weight_update" if at < 4 else call)
    assert calls.count(call) == (at + 1 if at < 4 else at - 3)
    # the next push builds a new group and succeeds
    fresh = RecordingGroup()
    pusher._make_group = lambda: fresh
    server.calls.clear()
    push_model(lambda: [pusher], model)
    assert len(fresh.broadcasts) == 6 and server.calls[-1][0] == "/resume"


def test_a_failing_server_call_is_not_retried_and_is_named():
    model = tiny_gpt_oss(seed=0)
    server = RecordingServer(fail={"/update_weights": VLLMServerError("HTTP 500: weight transfer engine missing")})
    group = RecordingGroup()
    with pytest.raises(NCCLTransferError, match=r"/update_weights failed \(VLLMServerError: HTTP 500"):
        push_model(lambda: [pusher_for(model, server, group)], model)
    assert [c for c, _ in server.calls].count("/update_weights") == 1 and group.closed


def test_reset_prefix_cache_refusal_is_an_error_and_generation_resumes():
    model = tiny_gpt_oss(seed=0)
    server, group = RecordingServer(reset_success=False), RecordingGroup()
    with pytest.raises(RuntimeError, match=r"gpu-server:8000 refused /reset_prefix_cache"):
        push_model(lambda: [pusher_for(model, server, group)], model)
    assert server.calls[-1][0] == "/resume"


def test_mismatched_layout_is_refused_before_anything_is_sent():
    model = tiny_gpt_oss(seed=0)
    served = tiny_gpt_oss(seed=0, intermediate_size=64)
    server, group = RecordingServer(), RecordingGroup()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*gpu-server:8000 expects"):
        push_model(lambda: [pusher_for(served, server, group)], model)
    assert server.calls == [] and group.broadcasts == []
