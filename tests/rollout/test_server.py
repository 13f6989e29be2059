"""VLLMServer launcher and ``trl-gptoss vllm-serve``: flags weight sync needs, teardown, death mid-rollout."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from trl_gptoss.rollout import GenerationRequest, VLLMServer, VLLMServerEngine, VLLMServerError
from trl_gptoss.rollout.server import WORKER_EXTENSION_DIR, free_port, live_group_members, vllm_python


def test_cpu_command_carries_weight_sync_flags(tiny_checkpoint):
    server = VLLMServer(tiny_checkpoint, device="cpu", extra_args=["--foo", 1])
    command = " ".join(server.command)
    for flag in (
        "-m vllm.entrypoints.openai.api_server",
        "--logprobs-mode processed_logprobs",
        "--worker-extension-cls gptoss_vllm_worker.GptOssWeightSyncExtension",
        "--dtype float32",
        "--enforce-eager",
        f"--model {tiny_checkpoint}",
        "--foo 1",
    ):
        assert flag in command
    assert "--weight-transfer-config" not in command
    assert server._env["VLLM_SERVER_DEV_MODE"] == "1" and server._env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert server._env["PYTHONPATH"].split(os.pathsep)[0] == str(WORKER_EXTENSION_DIR)
    assert (WORKER_EXTENSION_DIR / "gptoss_vllm_worker.py").is_file()


def test_gpu_command_uses_nccl_weight_transfer(tiny_checkpoint):
    command = " ".join(VLLMServer(tiny_checkpoint, device="cuda").command)
    assert '--weight-transfer-config {"backend": "nccl"}' in command and "--dtype auto" in command


def test_worker_extension_imports_in_the_vllm_interpreter_without_trl_gptoss():
    """The server's interpreter has neither trl_gptoss nor our transformers: the extension must load there."""
    check = (
        "import sys; sys.path.insert(0, sys.argv[1]); import gptoss_vllm_worker as w; "
        "assert not [m for m in sys.modules if m.startswith('trl_gptoss')]; "
        "print(w.GptOssWeightSyncExtension.gptoss_load_weights.__name__)"
    )
    out = subprocess.run(
        [str(vllm_python()), "-c", check, str(WORKER_EXTENSION_DIR)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert out.returncode == 0 and out.stdout.strip() == "gptoss_load_weights", out.stderr


def test_bad_arguments_are_rejected(tmp_path, tiny_checkpoint):
    with pytest.raises(ValueError, match="no config.json"):
        VLLMServer(tmp_path)
    with pytest.raises(ValueError, match="device must be"):
        VLLMServer(tiny_checkpoint, device="tpu")


def _wait_healthy(url: str, process: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            time.sleep(1)
    raise TimeoutError(url)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_cli_serves_and_death_mid_rollout_is_a_bounded_error(tiny_checkpoint):
    """`trl-gptoss vllm-serve` serves; when the server dies mid-rollout (SIGKILL to its process group), requests
    in flight and after get an error naming the URL within bounded time (no hang, no partial result), and the
    CLI exits leaving no process behind."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cli = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from trl_gptoss.cli import main; raise SystemExit(main())",
            "vllm-serve",
            "--model",
            str(tiny_checkpoint),
            "--port",
            str(port),
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "4",
            "--kv-cache-gib",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_healthy(url, cli)
        (server_pgid,) = _child_groups(cli.pid)
        engine = VLLMServerEngine(url, timeout=30, connect_timeout=2, max_retries=2, backoff=0.2)
        assert engine.generate_sync(GenerationRequest([5, 6, 7], 4, seed=0)).finish_reason == "length"

        async def rollout():
            long = [engine.generate(GenerationRequest([5, 6, 7], 4000, seed=i)) for i in range(4)]
            return await asyncio.gather(*long, return_exceptions=True)

        async def kill_soon():
            await asyncio.sleep(1.0)
            os.killpg(server_pgid, signal.SIGKILL)  # the server crashes mid-rollout

        started = time.monotonic()

        async def both():
            results, _ = await asyncio.gather(rollout(), kill_soon())
            return results

        results = asyncio.run(both())
        elapsed = time.monotonic() - started
        assert all(isinstance(r, VLLMServerError) and url in str(r) for r in results), results
        assert elapsed < 120
        assert cli.wait(timeout=60) != 0
        assert live_group_members(server_pgid) == [], "server processes survived"
        with pytest.raises(VLLMServerError, match=url):
            engine.generate_sync(GenerationRequest([5, 6, 7], 4, seed=0))
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
        cli.wait()


def _child_groups(pid: int) -> set[int]:
    """Process groups of the children of ``pid`` (the launcher starts the server in its own group)."""
    groups = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                groups.add(int(fields[2]))
    return groups
