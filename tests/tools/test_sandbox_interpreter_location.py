"""The sandbox covers /tmp with a private tmpfs; an interpreter that lives there must stay reachable.

Regression: a fresh clone under /tmp (its .venv included) failed every namespaced call with
FileNotFoundError, because the call's tmpfs hid the virtualenv.
"""

import subprocess
import sys

import pytest

from trl_gptoss.tools import PythonSandbox, detect_isolation


@pytest.mark.skipif(detect_isolation() != "namespaces", reason="the tmpfs covering /tmp is namespace-only")
def test_virtualenv_under_tmp_runs_code(tmp_path):
    assert str(tmp_path).startswith("/tmp/")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    result = PythonSandbox(python_executable=str(venv / "bin" / "python")).run(
        "import sys; print(sys.prefix); open('/tmp/work/x', 'w').write('scratch is writable')"
    )
    assert result.ok, result.stderr
    assert result.stdout.strip() == str(venv)
    denied = PythonSandbox(python_executable=str(venv / "bin" / "python")).run(
        f"open({str(venv / 'pyvenv.cfg')!r}, 'a').write('x')"
    )
    assert not denied.ok and ("Read-only" in denied.stderr or "Permission" in denied.stderr)
