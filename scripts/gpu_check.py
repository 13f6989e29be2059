"""The GPU check kit: one command proves the package's GPU path on a lent CUDA machine and writes every result.

    bash scripts/gpu_check.sh OUTDIR                 # a GPU host: at most --budget-s (480 s) on one H100/H200
    bash scripts/gpu_check.sh OUTDIR --dry-run       # the CPU: every part's logic at tiny sizes (in the suite)
    bash scripts/gpu_check.sh --stash                # first of two back-to-back device commands (the carry)

Stages, each in its own process with its own time cap, none stopping the next (each ends pass, fail or skip with
the reason):

1. ``setup``: reassemble and install the carry folder (``scripts/gpu_wheels.py``: pinned wheels the air-gapped
   host lacks, split over two commands of at most 64 MiB) into a private ``--target`` directory put first on
   ``PYTHONPATH``; the package itself is used from the checkout (``PYTHONPATH``, never ``pip install``: its pins
   would fight the host's torch); record versions and whether everything imports.
2. ``gpu_tests``: the ``gpu``-marked tests (vLLM ones deselected: no server on the host) with ``--junitxml``.
3. ``attention``, ``layer``, ``experts``, ``logprobs``: the self-verifying benchmarks ``benchmarks/
   bench_triton_attention.py``, ``bench_gpu_layer.py``, ``bench_gpu_experts.py``, ``bench_gpu_logprobs.py``.

Time: each stage has a nominal cap (``STAGES``) that later stages keep for themselves; the time an earlier stage
leaves unused flows to the ones after it, and the whole kit ends within ``--budget-s``. OUTDIR receives at most
8 files, what the device tool brings back: one JSON per part (``gpu_tests``, ``attention``, ``layer``,
``experts``, ``logprobs``), ``summary.json`` (which also holds the ``transfer`` part's record: the weight push's
process group), ``summary.md`` and ``kit.log`` (every stage's output).
This driver imports nothing of the package, so it reports even when the package cannot be imported.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".gpu-carry"
DEFAULT_WORK = Path("/tmp/trl-gptoss-kit")
DEFAULT_BUDGET_S = 480.0
# Test files holding gpu-marked tests the host can run (tests/scripts/test_gpu_check_dry_run.py keeps this list
# in step with the suite: every file with a gpu marker is here or needs vLLM).
GPU_TEST_FILES = (
    "tests/kernels/test_triton_attention.py",
    "tests/kernels/test_dispatch.py",
    "tests/attention/test_sync_free.py",
)
GPU_TEST_MARKER = "gpu and not vllm"
PER_TEST_TIMEOUT_S = 120  # FA4's first CuTe DSL compile of a case takes tens of seconds


class Context(NamedTuple):
    out: Path
    work: Path
    dry_run: bool
    env: dict
    log: Callable[[str], None]


class Stage(NamedTuple):
    """``nominal_s``: the time this stage keeps even when earlier stages overrun. ``run(ctx, timeout) -> record``
    (a dict with at least ``status`` and ``reason``); a benchmark stage writes its own JSON."""

    name: str
    nominal_s: float
    run: Callable[[Context, float], dict]


# ----------------------------------------------------------------------------------------------- carry (setup)
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest(search: list[Path]) -> tuple[Path, dict] | None:
    for folder in search:
        path = folder / "manifest.json"
        if path.is_file():
            return path, json.loads(path.read_text())
    return None


def carried_folders() -> list[Path]:
    """The ``.gpu-carry/*`` folders this command carried (``scripts/gpu_wheels.py`` writes them)."""
    return sorted(p for p in CARRY.glob("*") if p.is_dir())


def stash(work: Path) -> int:
    """First of two back-to-back device commands: copy the verified pieces carried now into ``work/stash``."""
    found = _manifest(carried_folders())
    if found is None:
        print(f"stash: no {CARRY.name}/*/manifest.json carried; nothing to keep")
        return 1
    manifest_path, manifest = found
    target = work / "stash"
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(manifest_path, target)
    kept = 0
    for piece in (piece for wheel in manifest["wheels"] for piece in wheel["pieces"]):
        for path in (folder / piece["file"] for folder in carried_folders()):
            if path.is_file() and _sha256(path) == piece["sha256"]:
                shutil.copy(path, target / piece["file"])
                kept += 1
                print(f"stash: kept {piece['file']} ({piece['size'] / 2**20:.1f} MiB) in {target}")
                break
    print(f"stash: {kept} piece(s) kept; start the kit within 30 s, before the machine goes back")
    return 0 if kept else 1


def assemble(manifest: dict, search: list[Path], wheels_dir: Path) -> dict[str, dict]:
    """Rebuild every wheel from its pieces; per group ``{"wheels": [paths], "reason": why not | ""}``. A group
    is all or nothing: half of FA4 installed would make ``flash_attn`` look importable and then fail."""
    wheels_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, dict] = {}
    for wheel in manifest["wheels"]:
        group = groups.setdefault(wheel["group"], {"wheels": [], "reason": ""})
        pieces = []
        for piece in wheel["pieces"]:
            found = [f / piece["file"] for f in search if (f / piece["file"]).is_file()]
            found = [p for p in found if p.stat().st_size == piece["size"]]
            if not found:
                group["reason"] = group["reason"] or (
                    f"{piece['file']} is missing (carried by the '{piece['command']}' command: "
                    "run `bash scripts/gpu_check.sh --stash` with it first, then the kit within 30 s)"
                )
            pieces.extend(found[:1])
        if group["reason"]:
            continue
        path = wheels_dir / wheel["wheel"]
        with path.open("wb") as joined:
            for piece in pieces:
                with piece.open("rb") as part:
                    shutil.copyfileobj(part, joined)
        if _sha256(path) != wheel["sha256"]:
            group["reason"] = f"{wheel['wheel']}: sha256 of the reassembled wheel does not match the manifest"
            continue
        group["wheels"].append(path)
    return groups


def _site_paths(site: Path, specs: list[dict]) -> list[str]:
    """``site`` and the folders its packages would add through ``.pth`` files (which PYTHONPATH never runs)."""
    return [str(site)] + [str(site / extra) for spec in specs for extra in spec["paths"]]


def install(ctx: Context, manifest: dict, timeout: float) -> dict:
    """Install each complete group into ``work/site`` (``pip --target``), check its import in a fresh process and
    put what imports first on the stages' ``PYTHONPATH``. A group that fails is removed again."""
    site = ctx.work / "site"
    shutil.rmtree(site, ignore_errors=True)
    groups = assemble(manifest, [*carried_folders(), ctx.work / "stash"], ctx.work / "wheels")
    deadline = time.monotonic() + timeout
    records, installed = {}, []
    base_path = ctx.env["PYTHONPATH"]
    for name, group in groups.items():
        spec = manifest["groups"][name]
        if group["reason"]:
            records[name] = {"installed": False, "reason": group["reason"], "what": spec["what"]}
            ctx.log(f"setup: {name} not installed: {group['reason']}")
            continue
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        pip += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, group["wheels"])]
        done = _run(ctx, pip, max(deadline - time.monotonic(), 10))
        ctx.env["PYTHONPATH"] = os.pathsep.join([*_site_paths(site, [*installed, spec]), base_path])
        check = done if done["rc"] else _run(ctx, [sys.executable, "-c", spec["import_check"]], 120)
        ok = check["rc"] == 0
        if ok:
            installed.append(spec)
        else:  # never leave a half-working package importable
            for top in spec["top_level"]:
                shutil.rmtree(site / top, ignore_errors=True)
        ctx.env["PYTHONPATH"] = os.pathsep.join([*_site_paths(site, installed), base_path])
        reason = "" if ok else f"{'pip' if done['rc'] else 'import check'} failed: {check['tail'][-400:]}"
        records[name] = {"installed": ok, "reason": reason, "what": spec["what"]}
        ctx.log(f"setup: {name} {'installed' if ok else 'NOT installed: ' + reason}")
    return records


_IMPORTS = """
import importlib.metadata as md, json, os
info, errors = {}, {}
for dist in ("torch", "triton", "transformers", "accelerate", "peft", "flash-attn-4", "nvidia-cutlass-dsl"):
    try:
        info[dist] = md.version(dist)
    except md.PackageNotFoundError:
        info[dist] = None
for module in ("torch", "transformers", "gptoss_kernels", "gptoss_kernels.triton", "trl_gptoss.attention",
               "trl_gptoss.experts"):
    try:
        __import__(module)
    except Exception as error:
        errors[module] = repr(error)
try:
    import torch, transformers
    from gptoss_kernels.fa4 import fa4_available
    info["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    info["torch_cuda"] = torch.version.cuda
    info["transformers_path"] = os.path.dirname(transformers.__file__)
    info["fa4_available"] = fa4_available()
except Exception as error:
    errors.setdefault("environment", repr(error))
info["import_errors"] = errors
print("KIT-ENV " + json.dumps(info))
"""


def setup(ctx: Context, timeout: float) -> dict:
    started = time.monotonic()
    found = None if ctx.dry_run else _manifest([*carried_folders(), ctx.work / "stash"])
    if found is None:
        carry = {"note": "dry run: the host's packages" if ctx.dry_run else "no carry folder: the host's packages"}
    else:
        carry = install(ctx, found[1], timeout * 0.8)
    done = _run(ctx, [sys.executable, "-c", _IMPORTS], max(timeout - (time.monotonic() - started), 20))
    lines = [line for line in done["tail"].splitlines() if line.startswith("KIT-ENV ")]
    environment = json.loads(lines[-1][len("KIT-ENV ") :]) if lines else {}
    errors = environment.get("import_errors") if lines else {"import check": done["tail"][-600:]}
    status = "fail" if errors or done["rc"] else "pass"
    reason = f"imports failed: {errors}" if errors else ("" if status == "pass" else f"exit {done['rc']}")
    return {"status": status, "reason": reason, "carry": carry, "environment": environment}


# ----------------------------------------------------------------------------------------------- running stages
def _run(ctx: Context, argv: list[str], timeout: float) -> dict:
    """Run ``argv`` in its own process group, output to the log; kill the group at ``timeout``."""
    started = time.monotonic()
    ctx.log(f"$ {' '.join(argv)}  (cap {timeout:.0f} s)")
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=ctx.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        rc = None
    ctx.log(output)
    return {"rc": rc, "output": output, "tail": output[-4000:], "elapsed_s": round(time.monotonic() - started, 1)}


def _benchmark(script: str, *, own_file: bool = True) -> Callable[[Context, float], dict]:
    """A benchmark stage. ``own_file=False``: its JSON stays in the work folder and its record travels inside
    summary.json (``parts``), for parts beyond the 8 files the device tool brings back."""

    def run(ctx: Context, timeout: float) -> dict:
        part = Path(script).stem
        path = (ctx.out if own_file else ctx.work) / f"{PART_NAMES[part]}.json"
        argv = [sys.executable, f"benchmarks/{script}", "--out", str(path)]
        argv += ["--budget-s", f"{max(timeout - 15, 5):.0f}"] + (["--dry-run"] if ctx.dry_run else [])
        done = _run(ctx, argv, timeout)
        return {**_from_json(path, done), "own_file": own_file}

    return run


def _from_json(path: Path, done: dict) -> dict:
    """The part's own record, or a failure saying why there is none (time cap, crash)."""
    record = None
    if path.is_file() and path.stat().st_mtime >= time.time() - done["elapsed_s"] - 5:
        record = json.loads(path.read_text())
    if done["rc"] is None:
        reason = f"killed at its time cap after {done['elapsed_s']} s"
        return {**(record or {}), "status": "fail", "reason": reason + (f"; {record['reason']}" if record else "")}
    if record is None:
        return {"status": "fail", "reason": f"exit {done['rc']} without its JSON: {done['tail'][-600:]}"}
    if done["rc"] != 0 and record.get("status") != "fail":
        return {**record, "status": "fail", "reason": f"exit {done['rc']}: {record.get('reason', '')}"}
    return record


def gpu_tests(ctx: Context, timeout: float) -> dict:
    junit = ctx.work / "gpu_tests.xml"
    junit.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA", "-m", GPU_TEST_MARKER]
    argv += [f"--junitxml={junit}", *GPU_TEST_FILES]
    if importlib.util.find_spec("pytest_timeout") is not None:  # one slow compile fails its test, not the stage
        argv.append(f"--timeout={min(PER_TEST_TIMEOUT_S, max(timeout - 10, 10)):.0f}")
    done = _run(ctx, argv, timeout)
    tests = _junit(junit) if junit.is_file() else _verbose_lines(done["output"])
    outcomes = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
    if done["rc"] is None:
        status, reason = "fail", f"killed at its time cap after {done['elapsed_s']} s (results up to then kept)"
    elif outcomes["failed"] or outcomes["error"] or done["rc"] not in (0, 5):
        status = "fail"
        reason = f"{outcomes['failed']} failed, {outcomes['error']} errors (pytest exit {done['rc']})"
    elif not outcomes["passed"]:
        status, reason = "skip", "no gpu test ran here: " + "; ".join(sorted({t["message"] for t in tests})[:3])
    else:
        status, reason = "pass", ""
    table = ["| test | outcome | s | message |", "|---|---|---|---|"]
    table += [f"| {t['id']} | {t['outcome']} | {t['time']:.1f} | {t['message'][:120]} |" for t in tests]
    record = {"part": "gpu_tests", "status": status, "reason": reason, "dry_run": ctx.dry_run, "counts": outcomes}
    record.update(elapsed_s=done["elapsed_s"], files=list(GPU_TEST_FILES), marker=GPU_TEST_MARKER, tests=tests)
    record["table_md"] = "\n".join(table) if tests else ""
    if not tests or status == "fail":
        record["output_tail"] = done["tail"][-3000:]
    (ctx.out / "gpu_tests.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def _verbose_lines(output: str) -> list[dict]:
    """Outcomes from ``pytest -v`` lines: what a run killed at its cap (no junit file) had finished."""
    outcomes = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "error"}
    outcomes.update(XFAIL="skipped", XPASS="passed")
    tests = {}
    for line in output.splitlines():
        match = _VERBOSE.match(line)
        if match:
            tests[match[1]] = {"id": match[1], "outcome": outcomes[match[2]], "time": 0.0, "message": "from -v output"}
    return list(tests.values())


def _junit(path: Path) -> list[dict]:
    """One record per test case of a pytest ``--junitxml`` file: id, outcome, seconds, first message line."""
    outcomes = {"failure": "failed", "error": "error", "skipped": "skipped"}
    tests = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in outcomes:
                outcome = outcomes[child.tag]
                message = ((child.get("message") or child.text or "").strip().splitlines() or [""])[0][:300]
        test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        tests.append({"id": test_id, "outcome": outcome, "time": float(case.get("time") or 0), "message": message})
    return tests


PART_NAMES = {
    "bench_triton_attention": "attention",
    "bench_gpu_layer": "layer",
    "bench_gpu_experts": "experts",
    "bench_gpu_logprobs": "logprobs",
    "bench_gpu_transfer": "transfer",
}
STAGES = (
    Stage("setup", 60, setup),
    Stage("gpu_tests", 120, gpu_tests),
    Stage("attention", 150, _benchmark("bench_triton_attention.py")),
    Stage("layer", 70, _benchmark("bench_gpu_layer.py")),
    Stage("experts", 35, _benchmark("bench_gpu_experts.py")),
    Stage("logprobs", 30, _benchmark("bench_gpu_logprobs.py")),
    Stage("transfer", 40, _benchmark("bench_gpu_transfer.py", own_file=False)),  # the weight push's process group
)


# ----------------------------------------------------------------------------------------------- summary
def summary_md(summary: dict, records: dict[str, dict]) -> str:
    env = summary["environment"]
    lines = [
        f"# GPU check kit{' (dry run)' if summary['dry_run'] else ''}: {summary['verdict']}",
        "",
        f"Device: {env.get('cuda') or 'no CUDA device'}; torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), "
        f"triton {env.get('triton')}, transformers {env.get('transformers')}, flash-attn-4 {env.get('flash-attn-4')} "
        f"(FA4 usable: {env.get('fa4_available')}). {summary['elapsed_s']:.0f} s of a {summary['budget_s']:.0f} s "
        "budget.",
        "",
        "| part | status | s | cap s | reason |",
        "|---|---|---|---|---|",
    ]
    for stage in summary["stages"]:
        lines.append(
            f"| {stage['name']} | {stage['status']} | {stage['elapsed_s']:.0f} | {stage['cap_s']:.0f} | "
            f"{stage['reason'][:300]} |"
        )
    carry = records["setup"].get("carry", {})
    if isinstance(carry, dict) and "note" not in carry:
        lines += ["", "Carry folder:"]
        lines += [
            f"- {g}: {'installed' if c['installed'] else 'not installed: ' + c['reason']}" for g, c in carry.items()
        ]
    for name, record in records.items():
        if name == "setup":
            continue
        lines += ["", f"## {name}: {record.get('status')}", ""]
        if record.get("reason"):
            lines += [record["reason"], ""]
        if record.get("table_md"):
            lines += [record["table_md"], ""]
        for goal in record.get("goals", []):
            value = "—" if goal["value"] is None else f"{goal['value']:.3g}"
            unjudged = "not judged (dry run)" if summary["dry_run"] else "not measured"
            met = {True: "met", False: "MISSED", None: unjudged}[goal["met"]]
            lines.append(f"- goal: {goal['name']}: {value} ({goal['target']}): {met}")
        failed = [c for c in record.get("checks", []) if not c["ok"]]
        lines += [f"- check FAILED: {c['name']}: {c['error']:.3e} > {c['tolerance']:.3e}" for c in failed]
        lines += [f"- skipped {_case(s)}: {s['reason']}" for s in record.get("skipped", [])]
    return "\n".join(lines) + "\n"


def _case(skip: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in skip.items() if k != "reason")


def run_kit(out: Path, work: Path, dry_run: bool, budget_s: float) -> int:
    started = time.monotonic()
    deadline = started + budget_s
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log_file = (out / "kit.log").open("w")

    def log(text: str) -> None:
        log_file.write(text.rstrip("\n") + "\n")
        log_file.flush()
        print(text.rstrip("\n")[-3000:], flush=True)

    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "kernels"), env.get("PYTHONPATH")])),
        TRITON_INTERPRET="1" if dry_run else "0",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    # FA4 compiles each case once for all stages (the tests' kernels serve the benchmarks) through its disk cache;
    # FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0 on the command line turns that off.
    env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(work / "fa4-cache"))
    if dry_run:
        env.setdefault("OMP_NUM_THREADS", "1")
    ctx = Context(out, work, dry_run, env, log)
    records, stages = {}, []
    for index, stage in enumerate(STAGES):
        reserve = sum(s.nominal_s for s in STAGES[index + 1 :])
        cap = max(deadline - time.monotonic() - reserve, 5.0)
        log(f"=== {stage.name} (cap {cap:.0f} s) ===")
        begun = time.monotonic()
        try:
            record = stage.run(ctx, cap)
        except Exception as error:  # the driver's own bug must not lose the other stages
            record = {"status": "fail", "reason": f"kit error: {type(error).__name__}: {error}"}
        records[stage.name] = record
        elapsed = time.monotonic() - begun
        stages.append({"name": stage.name, "status": record["status"], "reason": record.get("reason", ""),
                       "elapsed_s": round(elapsed, 1), "cap_s": round(cap, 1)})  # fmt: skip
        log(f"=== {stage.name}: {record['status']} in {elapsed:.0f} s {record.get('reason', '')[:500]}")
    counts = {s: sum(st["status"] == s for st in stages) for s in ("pass", "fail", "skip")}
    summary = {
        "kit": "trl-gptoss GPU check",
        "dry_run": dry_run,
        "verdict": f"{counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip",
        "budget_s": budget_s,
        "elapsed_s": round(time.monotonic() - started, 1),
        "environment": records["setup"].get("environment", {}),
        "setup": {k: v for k, v in records["setup"].items() if k != "environment"},
        "stages": stages,
        "goals": {name: r.get("goals", []) for name, r in records.items() if r.get("goals")},
        "parts": {name: r for name, r in records.items() if r.get("own_file") is False},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(summary_md(summary, records))
    log(f"GPU check kit: {summary['verdict']} in {summary['elapsed_s']:.0f} s -> {out}/summary.md")
    log_file.close()
    return 1 if counts["fail"] else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The GPU check kit (docs/triton_kernels.md, 'GPU check kit').")
    parser.add_argument("out", nargs="?", help="folder for the JSON per part, summary.json, summary.md, kit.log")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreted")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole kit's time")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="scratch: stash, wheels, site, caches")
    parser.add_argument("--stash", action="store_true", help="keep the carried pieces for the next command")
    args = parser.parse_args(argv)
    if args.stash:
        return stash(args.work)
    if not args.out:
        parser.error("OUTDIR is required (or --stash)")
    return run_kit(Path(args.out).resolve(), args.work, args.dry_run, args.budget_s)


if __name__ == "__main__":
    raise SystemExit(main())
