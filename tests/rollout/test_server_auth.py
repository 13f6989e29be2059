"""Who may change a rollout server: the run's secret guards every route that changes or pauses the server.

The middleware is tested as the ASGI callable vLLM loads; the launcher's rules (secret by environment, loopback
without one) on its command and environment; end to end, a server the trainer starts (its secret made for the
run) refuses an unauthenticated weight load, pause and cache reset -- the served log-probs do not move -- while the
trainer's own pushes pass ``check_sync``.
"""

import asyncio
import base64
import json
import os
import subprocess

import pytest
import torch

from trl_gptoss.rollout.server import VLLMServer
from trl_gptoss.rollout.server_secret import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    auth_headers,
    new_secret,
    read_secret_file,
    secret_from_environment,
)
from trl_gptoss.rollout.vllm_worker import gptoss_vllm_auth
from trl_gptoss.rollout.vllm_worker.gptoss_vllm_auth import SecretMiddleware

SECRET = "s3cret-for-tests-only-0123456789"
CHANGING = [
    ("POST", "/collective_rpc"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/reset_mm_cache"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/start_weight_update"),
    ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"),
    ("POST", "/sleep"),
    ("POST", "/v1/load_lora_adapter"),
    ("GET", "/server_info"),  # its environment dump would show the secret
    ("POST", "/a_route_a_later_vllm_adds"),
]
SERVING = [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions"), ("HEAD", "/health")]


def _call(middleware, method, path, headers=(), root_path=""):
    """The status the middleware answers (200: passed to the app)."""
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": method, "path": root_path + path, "root_path": root_path, "headers": headers}
    asyncio.run(
        SecretMiddleware(app, SECRET)(scope, receive, send) if middleware is None else middleware(scope, receive, send)
    )
    return sent[0]["status"]


def _headers(secret):
    return [(k.lower().encode(), v.encode()) for k, v in auth_headers(secret).items()]


@pytest.mark.parametrize("method, path", CHANGING, ids=[p for _, p in CHANGING])
def test_routes_that_change_the_server_need_the_secret(method, path):
    assert _call(None, method, path) == 401
    assert _call(None, method, path, _headers("wrong-secret-0123456789")) == 401
    assert _call(None, method, path, [(b"authorization", SECRET.encode())]) == 401  # not "Bearer <secret>"
    assert _call(None, method, path, _headers(SECRET) * 2) == 401  # two credentials: refused, not guessed
    assert _call(None, method, path, _headers(SECRET)) == 200
    assert _call(None, method, path, _headers(SECRET), root_path="/prefix") == 200
    assert _call(None, method, path, root_path="/prefix") == 401


@pytest.mark.parametrize("method, path", SERVING, ids=[f"{m}{p}" for m, p in SERVING])
def test_serving_and_read_only_routes_stay_open(method, path):
    assert _call(None, method, path) == 200
    assert _call(None, "DELETE", path) == 401  # another method on an open path is not open


def test_the_middleware_will_not_start_open(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(RuntimeError, match=SECRET_ENV):
        SecretMiddleware(lambda *a: None)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert _call(SecretMiddleware(lambda *a: None), "POST", "/pause") == 401
    assert gptoss_vllm_auth.SECRET_ENV == SECRET_ENV  # the server-side file cannot import the constant


def test_secrets_come_from_the_environment_or_a_private_file(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    assert secret_from_environment() is None
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=f"can be read by other users .*chmod 600 {path}"):
        read_secret_file(path)
    path.chmod(0o600)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    assert secret_from_environment() == SECRET
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=f"\\${SECRET_ENV}: a server secret must be at least 16"):
        secret_from_environment()
    with pytest.raises(ValueError, match="secret file .*missing"):
        read_secret_file(tmp_path / "missing")


def test_a_secret_file_is_refused_unless_it_and_its_directory_are_yours_and_it_is_small(tmp_path):
    """A private file another user planted (any mode), one in a directory others may write (not sticky) or own,
    and an oversized file are refused, each message naming the file; a sticky shared directory is fine."""
    from trl_gptoss.rollout.server_secret import MAX_SECRET_FILE_BYTES

    def private(directory, text=SECRET + "\n"):
        path = directory / "secret"
        path.write_text(text)
        path.chmod(0o600)
        return path

    big = private(tmp_path, SECRET + " " * MAX_SECRET_FILE_BYTES)
    with pytest.raises(ValueError, match=f"secret file {big} is larger than {MAX_SECRET_FILE_BYTES} bytes"):
        read_secret_file(big)
    shared = tmp_path / "shared"
    shared.mkdir()
    path = private(shared)
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=f"secret file {path} is in {shared}, which other users can write"):
        read_secret_file(path)
    link = tmp_path / "link"
    link.symlink_to(path)  # a link of ours to a file in a directory others may write
    with pytest.raises(ValueError, match=f"secret file {link} is in {shared}, which other users can write"):
        read_secret_file(link)
    shared.chmod(0o1777)  # sticky: others cannot rename or remove our file
    assert read_secret_file(path) == SECRET == read_secret_file(link)
    if os.geteuid() != 0:
        return  # planting a file or a directory of another user needs root
    os.chown(path, 65534, 65534)
    with pytest.raises(ValueError, match=f"secret file {path} belongs to uid 65534, not to you"):
        read_secret_file(path)
    os.chown(path, 0, 0)
    os.chown(shared, 65534, 65534)
    with pytest.raises(ValueError, match=f"secret file {path} is in {shared}, which belongs to uid 65534"):
        read_secret_file(path)


def test_the_secret_reaches_the_server_by_environment_and_guards_it(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    secret = new_secret()
    server = VLLMServer(tiny_checkpoint, device="cpu", secret=secret, host="0.0.0.0")
    assert secret not in " ".join(server.command), "a secret on the command line is visible to every local user"
    assert server._env[SECRET_ENV] == secret
    assert server.command[server.command.index("--middleware") + 1] == "gptoss_vllm_auth.SecretMiddleware"
    assert server.base_url.startswith("http://127.0.0.1:")
    monkeypatch.setenv(SECRET_ENV, "inherited-but-not-ours-0123456789")
    open_server = VLLMServer(tiny_checkpoint, device="cpu", secret=None)
    assert open_server.secret == "inherited-but-not-ours-0123456789"  # the user's environment names it
    monkeypatch.delenv(SECRET_ENV)
    open_server = VLLMServer(tiny_checkpoint, device="cpu")
    assert "--middleware" not in open_server.command and SECRET_ENV not in open_server._env


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7"])
def test_a_bind_other_machines_reach_needs_a_secret(tiny_checkpoint, host, monkeypatch, capsys):
    from trl_gptoss.cli import main

    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match="not a loopback address.*secret"):
        VLLMServer(tiny_checkpoint, device="cpu", host=host)
    assert main(["vllm-serve", "--model", str(tiny_checkpoint), "--host", host, "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert f"--host {host} is not a loopback address" in error and "Give --secret-file FILE" in error
    for loopback in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        VLLMServer(tiny_checkpoint, device="cpu", host=loopback)


REACH_SPELLINGS = [
    (["--host", "0.0.0.0"], "--host", "use --host"),
    (["--host=0.0.0.0"], "--host", "use --host"),
    (["--hos", "0.0.0.0"], "--host", "use --host"),  # argparse takes a unique prefix
    (["--port", "8001"], "--port", "use --port"),
    (["--uds", "/tmp/vllm.sock"], "--uds", "use --host"),
    (["--middleware", "my.Middleware"], "--middleware", "use --secret-file"),
    (["--api_key", "k"], "--api-key", "use --secret-file"),  # vLLM reads underscores as dashes
    (["--api-key=k"], "--api-key", "use --secret-file"),
    (["--config", "serve.yaml"], "--config", "use the flags themselves"),
    (["--allowed-origins", '["*"]'], "--allowed-origins", "no option of ours sets it"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile", "no option of ours"),
    (["--worker-extension-cls", "x.Y"], "--worker-extension-cls", "no option of ours"),
    (["--kv-transfer-config.kv_ip=0.0.0.0"], "--kv-transfer-config", "no option of ours"),
    (["-dpa", "0.0.0.0"], "--data-parallel-address", "no option of ours"),
]


@pytest.mark.parametrize(
    "extra, flag, instead", [pytest.param(*case, id=" ".join(case[0])) for case in REACH_SPELLINGS]
)
def test_pass_through_flags_cannot_change_who_reaches_the_server(tiny_checkpoint, extra, flag, instead, capsys):
    """vLLM keeps the last of a repeated flag, so a pass-through ``--host 0.0.0.0`` would bind every interface
    with no secret: refused in ``VLLMServer`` and in ``vllm-serve``, naming the option of ours to use."""
    from trl_gptoss.cli import main

    with pytest.raises(ValueError, match="not accepted among the pass-through flags") as refused:
        VLLMServer(tiny_checkpoint, device="cpu", extra_args=["--enable-prefix-caching", *extra])
    assert flag in str(refused.value) and instead in str(refused.value)
    command = ["vllm-serve", "--model", str(tiny_checkpoint), "--device", "cpu", "--", *extra]
    assert main(command) == 2
    error = capsys.readouterr().err
    assert error.startswith("trl-gptoss vllm-serve: the vLLM flag") and flag in error and instead in error


def test_other_pass_through_flags_still_reach_vllm(tiny_checkpoint):
    extra = ["--enable-prefix-caching", "--served-model-name", "host", "--no-allow-credentials", "--max-logprobs=5"]
    server = VLLMServer(tiny_checkpoint, device="cpu", extra_args=extra)
    start = server.command.index(extra[0])
    assert server.command[start : start + len(extra)] == extra
    assert server.command.count("--host") == 1 and server.command.count("--port") == 1


def test_the_refused_flags_are_the_ones_vllms_parser_reads(tmp_path):
    """In the server's interpreter: every refused spelling sets the guarded option in vLLM's own parser, every
    guarded flag exists there, and no other flag of vLLM's is refused."""
    from trl_gptoss.rollout import server_flags
    from trl_gptoss.rollout.server import vllm_python

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib.util, json, sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "spec = importlib.util.spec_from_file_location('server_flags', sys.argv[1])\n"
        "flags = importlib.util.module_from_spec(spec); spec.loader.exec_module(flags)\n"
        "parser = make_arg_parser(FlexibleArgumentParser())\n"
        "options = {o: a.dest for a in parser._actions for o in a.option_strings}\n"
        "missing = [f for f in flags.GUARDED_FLAGS if f not in options]\n"
        "wrongly = [o for o in options if o.startswith('--') and o not in flags.GUARDED_FLAGS\n"
        "           and flags.guarded_flag(o)]\n"
        "spellings = {'--hos': '--host', '--api_key': '--api-key', '-dpa': '--data-parallel-address'}\n"
        "read_as = {s: options[g] for s, g in spellings.items()\n"
        "           if vars(parser.parse_args(['--model', 'm', s, 'v'])).get(options[g]) in ('v', ['v'])}\n"
        "print(json.dumps({'missing': missing, 'wrongly': wrongly, 'read_as': sorted(read_as)}))\n"
    )
    out = subprocess.run(
        [str(vllm_python()), str(probe), server_flags.__file__], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == {"missing": [], "wrongly": [], "read_as": ["--api_key", "--hos", "-dpa"]}


def test_the_worker_reads_only_push_files(tmp_path):
    from safetensors.torch import save_file

    from trl_gptoss.rollout.vllm_worker.gptoss_vllm_worker import _read_source

    other = tmp_path / "model.safetensors"
    save_file({"x": torch.ones(2)}, str(other))
    with pytest.raises(ValueError, match="not a push file"):
        _read_source(json.dumps({"path": str(other)}))
    push = tmp_path / "gptoss-push-abc_123.safetensors"
    os.link(other, push)
    assert torch.equal(_read_source(json.dumps({"path": str(push)}))["x"], torch.ones(2))


# -- end to end: a server the trainer starts -----------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_started(tiny_checkpoint):
    """``(engine, model, release)`` built the way the trainer builds them (``rollout_server_url: null``)."""
    from types import SimpleNamespace

    from transformers import GptOssForCausalLM

    from trl_gptoss.testing import harmony_tokenizer
    from trl_gptoss.trainer.sampling import ENGINE_KINDS

    model = GptOssForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation="eager")
    args = SimpleNamespace(
        rollout_backend="vllm_server",
        rollout_server_url=None,
        rollout_max_model_len=256,
        rollout_server_timeout=900,
        routing_replay="off",
    )
    saved = {k: os.environ.pop(k) for k in (SECRET_ENV, SECRET_FILE_ENV) if k in os.environ}
    built = ENGINE_KINDS["vllm_server"].build(args, model.eval(), harmony_tokenizer())
    try:
        yield built.engine, model
    finally:
        built.engine.close()
        built.release()
        os.environ.update(saved)


def _raw(url, method, path, payload=None, secret=None):
    from trl_gptoss.rollout.http_async import AsyncHTTPClient, request_blocking

    client = AsyncHTTPClient(url, connect_timeout=5, max_connections=1, headers=auth_headers(secret))
    return request_blocking(client, method, path, payload, timeout=60)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.xdist_group("vllm")
def test_unauthenticated_loads_pauses_and_resets_are_refused_and_change_nothing(trainer_started):
    from safetensors.torch import save

    engine, model = trainer_started
    url = engine.base_url
    sequence = [5, 40, 41, 42, 7, 300, 301, 17, 99, 100]
    before = engine.score(sequence)
    sinks = {n: torch.full_like(p, 9.0) for n, p in model.named_parameters() if n.endswith("sinks")}
    load = {"method": "gptoss_load_weights", "args": [json.dumps({"b64": base64.b64encode(save(sinks)).decode()})]}
    for secret in (None, "a-guess-that-is-long-enough-0123"):
        for method, path, payload in [
            ("POST", "/collective_rpc", load),
            ("POST", "/collective_rpc", {"method": "gptoss_start_reload", "args": []}),
            ("POST", "/pause?mode=abort", None),
            ("POST", "/reset_prefix_cache", None),
            ("POST", "/resume", None),
            ("GET", "/server_info", None),
        ]:
            answer = _raw(url, method, path, payload, secret)
            assert answer.status == 401, f"{method} {path} with secret={secret!r}: HTTP {answer.status}"
    assert _raw(url, "GET", "/is_paused").json() == {"is_paused": False}
    assert engine.score(sequence) == before, "an unauthenticated call moved the served log-probs"


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of this host's TCP sockets listening on ``port`` (``/proc/net/tcp`` and ``tcp6``)."""
    import ipaddress

    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.split(":")
                if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(address)  # the kernel prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(str(ipaddress.ip_address(words)))
    return found


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.xdist_group("vllm")
def test_the_started_server_listens_on_loopback_only(trainer_started):
    engine, _ = trainer_started
    port = int(engine.base_url.rsplit(":", 1)[1].strip("/"))
    assert _listening_addresses(port) == {"127.0.0.1"}, "the server must bind loopback when it has no host of ours"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.xdist_group("vllm")
def test_the_trainers_own_pushes_still_pass_check_sync(trainer_started):
    from trl_gptoss.rollout.vllm_engine import VLLMServerEngine, VLLMServerError
    from trl_gptoss.rollout.weights.check_sync import check_sync, random_prompts

    engine, model = trainer_started
    prompts = random_prompts(model.config.vocab_size, 2, 12, seed=3)
    report = check_sync([engine], model, prompts, groups=("sinks", "experts"))
    assert report.ok, report.failed
    stranger = VLLMServerEngine(engine.base_url, max_retries=0)  # no secret in this environment
    try:
        with pytest.raises(VLLMServerError, match=f"{engine.base_url}/collective_rpc answered HTTP 401.*SECRET"):
            stranger.push_weights(model)
    finally:
        stranger.close()
