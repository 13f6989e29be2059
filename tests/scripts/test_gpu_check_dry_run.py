"""The GPU check kit between GPU lends: its CPU dry run writes every part's JSON and the summary, its list of GPU
test files follows the suite, and the carry folder (split over two device commands) reassembles byte for byte."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("gpu_tests", "attention", "layer", "experts", "logprobs")
IN_SUMMARY = ("transfer",)  # parts whose record travels inside summary.json (the device tool's 8-file limit)


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_kit_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")
gpu_wheels = _load("gpu_wheels")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dry_run_writes_every_part_and_the_summary(tmp_path):
    """``bash scripts/gpu_check.sh OUT --dry-run``: each benchmark verifies and measures its tiny CPU cases, the
    GPU tests are collected and skipped, and OUT holds at most the 8 files the device tool brings back."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    argv = ["bash", "scripts/gpu_check.sh", str(out), "--dry-run", "--work", str(tmp_path / "work")]
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    names = {p.name for p in out.iterdir()}
    assert names == {f"{p}.json" for p in PARTS} | {"summary.json", "summary.md", "kit.log"}, names
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["stages"]] == ["setup", *PARTS, *IN_SUMMARY]
    assert summary["elapsed_s"] <= summary["budget_s"] and summary["setup"]["status"] == "pass", summary["setup"]
    assert set(summary["parts"]) == set(IN_SUMMARY)
    for part in PARTS[1:] + IN_SUMMARY:
        record = summary["parts"][part] if part in IN_SUMMARY else json.loads((out / f"{part}.json").read_text())
        assert record["status"] == "pass" and record["dry_run"], (part, record["reason"])
        assert record["rows"] and record["checks"] and all(c["ok"] for c in record["checks"]), part
        assert all(goal["met"] is None for goal in record["goals"]), "a dry run judges no goal"
        assert record["table_md"] in (out / "summary.md").read_text()
    tests = json.loads((out / "gpu_tests.json").read_text())
    assert tests["status"] == "skip" and tests["counts"]["skipped"] == len(tests["tests"]) > 0
    ids = {t["id"].split("[")[0] for t in tests["tests"]}
    for expected in (
        "tests/kernels/test_triton_attention.py::test_gpt_oss_shape_bf16_on_gpu",
        "tests/kernels/test_triton_attention.py::test_fa4_gpt_oss_shape_bf16_on_gpu",
        "tests/kernels/test_dispatch.py::test_auto_choice_per_case_on_gpu",
        "tests/attention/test_sync_free.py::test_no_cuda_sync_after_the_first_layer",
    ):
        assert expected in ids, sorted(ids)
    attention = json.loads((out / "attention.json").read_text())
    assert {s["impl"] for s in attention["skipped"]} >= {"fa4", "hf-fa4"}, "FA4 rows say why they did not run"
    assert {d["backend"] for d in attention["dispatch"]} == {"chunked"}


def test_gpu_test_files_are_every_file_with_a_gpu_test():
    """A new GPU test file is run by the kit (or needs vLLM, which the lent host does not have)."""
    marker, vllm = "pytest.mark." + "gpu", "pytest.mark." + "vllm"
    with_gpu_tests = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if marker in path.read_text() and vllm not in path.read_text()
    }
    assert with_gpu_tests == set(gpu_check.GPU_TEST_FILES)


def _fake_wheels(folder, sizes):
    folder.mkdir()
    paths = {}
    for index, (name, size) in enumerate(sizes.items()):
        paths[name] = folder / f"{name}-1.0-py3-none-any.whl"
        paths[name].write_bytes(os.urandom(size) if index % 2 else bytes([index]) * size)
    return paths


def test_carry_splits_over_two_commands_and_reassembles(tmp_path, monkeypatch):
    kib = 1024
    paths = _fake_wheels(tmp_path / "wheels", {"small": 300 * kib, "tiny": 50 * kib, "big": 1024 * kib})
    groups = {"small": "one", "tiny": "two", "big": "two"}
    carry = tmp_path / ".gpu-carry"
    limit, margin, repo = 1024 * kib, 64 * kib, 100 * kib
    manifest = gpu_wheels.write_carry(paths, groups, carry, repo, limit, margin)
    manifest["groups"] = {"one": {}, "two": {}}
    for command in ("stash", "run"):
        size = sum(p.stat().st_size for p in (carry / command).iterdir())
        assert repo + size <= limit - margin + 8 * kib, (command, size)  # + the manifest
    assert [p["command"] for w in manifest["wheels"] if w["wheel"].startswith("big") for p in w["pieces"]] == [
        "stash",
        "run",
    ]
    # the second command alone: the split group is refused with the way to fix it, the other group installs
    groups_run = gpu_check.assemble(manifest, [carry / "run"], tmp_path / "joined-run")
    assert groups_run["one"]["reason"] == "" and len(groups_run["one"]["wheels"]) == 1
    assert "--stash" in groups_run["two"]["reason"] and "'stash' command" in groups_run["two"]["reason"]
    # command 1 stashes its piece on the host; command 2 finds it there
    monkeypatch.setattr(gpu_check, "CARRY", tmp_path / "only-stash")
    (tmp_path / "only-stash").mkdir()
    (carry / "stash").rename(tmp_path / "only-stash" / "stash")
    assert gpu_check.stash(tmp_path / "work") == 0
    joined = gpu_check.assemble(manifest, [carry / "run", tmp_path / "work" / "stash"], tmp_path / "joined")
    assert all(group["reason"] == "" for group in joined.values()), joined
    for group in joined.values():
        for path in group["wheels"]:
            assert path.read_bytes() == paths[path.name.split("-")[0]].read_bytes()
    assert (carry / ".gitignore").read_text().splitlines()[-1] == "*"


def test_carry_that_cannot_fit_two_commands_is_refused():
    with pytest.raises(ValueError, match="do not fit two commands"):
        gpu_wheels.plan({"big": 3000, "small": 100}, repo=100, limit=1000, margin=0)
    with pytest.raises(ValueError, match="small wheels alone"):
        gpu_wheels.plan({"big": 3000, "a": 600, "b": 600}, repo=100, limit=1000, margin=0)
    assert gpu_wheels.plan({"a": 100, "b": 200}, repo=100, limit=1000, margin=0) == {
        "stash": [],
        "run": [("a", 0, 100), ("b", 0, 200)],
    }


def test_a_gpu_test_run_killed_at_its_cap_keeps_what_finished():
    output = "tests/kernels/test_dispatch.py::test_a[bf16-x] PASSED   [ 10%]\nnoise\ntests/k.py::test_b FAILED [ 20%]"
    assert [(t["id"], t["outcome"]) for t in gpu_check._verbose_lines(output)] == [
        ("tests/kernels/test_dispatch.py::test_a[bf16-x]", "passed"),
        ("tests/k.py::test_b", "failed"),
    ]
