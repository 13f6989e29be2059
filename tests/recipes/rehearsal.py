"""Running a shipped recipe the way its header comment launches it, and reading what the run left behind.

``launch_flags(yaml)`` reads the ``accelerate launch`` line of the recipe's header comment; ``rehearse`` runs it
(``tests/recipes/_rehearse.py`` in place of ``examples/retool_grpo.py``, once per machine of a multi-node
line) and returns a ``Rehearsal``: exit codes, the rank-0 machine's output, the job's log history and summary,
and the probe's record (``_rehearse.py``). ``fp32_replay`` re-applies the run's optimizer steps to fp32 copies
of the initial trainable parameters, from the gradients the probe saved.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
WRAPPER = Path(__file__).with_name("_rehearse.py")
SCRIPT = "examples/retool_grpo.py"


def training_yamls() -> list[Path]:
    """Every job YAML shipped in ``examples/configs`` (the ``accelerate*.yaml`` files configure launches)."""
    return sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("accelerate"))


def launch_flags(yaml_path: Path) -> dict[str, str | bool]:
    """The flags between ``accelerate launch`` and ``examples/retool_grpo.py`` in the recipe's header comment
    (``--flag value`` -> ``{"flag": "value"}``, a bare ``--flag`` -> ``True``), continuation lines joined."""
    header = []
    for line in yaml_path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    text = " ".join(header).replace("\\ ", " ")
    start = text.find("accelerate launch")
    end = text.find(SCRIPT, start)
    if start < 0 or end < 0:
        raise ValueError(f"{yaml_path.name}: no `accelerate launch ... {SCRIPT}` line in the header comment")
    tokens = shlex.split(text[start + len("accelerate launch") : end])
    flags: dict[str, str | bool] = {}
    for i, token in enumerate(tokens):
        if token.startswith("--"):
            value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else True
            flags[token[2:]] = value
    return flags


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _argv(values: dict, *, bare_true: bool) -> list[str]:
    """``--key value`` pairs (booleans as ``true``/``false``); with ``bare_true``, ``True`` is a bare flag
    (accelerate's ``--cpu``)."""
    out = []
    for key, value in values.items():
        if value is True and bare_true:
            out.append(f"--{key}")
        else:
            out += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def _wait(procs: list[subprocess.Popen], timeout: float, grace: float = 30.0) -> list[int | None]:
    """Exit codes once every launch ended, or ``None`` for those still running at ``timeout``, or ``grace``
    seconds after one failed (its peers would otherwise wait out torchelastic's 300 s barriers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.5)
    return [p.poll() for p in procs]


@dataclass
class Rehearsal:
    """What one rehearsal run left: exit codes, output (rank-0 machine, stdout and stderr), timings, the job's
    ``trainer_state.json`` log history and ``summary.json``, the probe's record and directory."""

    name: str
    codes: list[int]
    output: str
    seconds: float
    output_dir: Path
    probe_dir: Path
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    probe: dict = field(default_factory=dict)

    @property
    def steps(self) -> list[dict]:
        """One log entry per optimizer step (TRL logs ``reward`` every step here: ``logging_steps: 1``)."""
        return [h for h in self.history if "reward" in h]


def rehearse(
    name: str,
    flags: dict,
    overrides: dict,
    workdir: Path,
    *,
    machines: int = 1,
    env: dict | None = None,
    timeout: float = 600.0,
) -> Rehearsal:
    """Launch ``accelerate launch FLAGS _rehearse.py --config <name>.yaml OVERRIDES`` (``machines`` launches with
    ``--machine_rank`` 0.., started together as on separate nodes) and wait for all of them."""
    workdir.mkdir(parents=True, exist_ok=True)
    probe_dir = workdir / "probe"
    probe_dir.mkdir()
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "REHEARSAL_PROBE": str(probe_dir),
        "PYTHONFAULTHANDLER": "1",  # a rank that aborts prints every thread's stack
        **(env or {}),
    }
    yaml_path = CONFIGS / f"{name}.yaml"
    procs, logs = [], []
    start = time.perf_counter()
    for machine in range(machines):
        machine_flags = dict(flags, machine_rank=machine) if machines > 1 else flags
        command = [sys.executable, "-m", "accelerate.commands.launch", *_argv(machine_flags, bare_true=True)]
        command += [str(WRAPPER), "--config", str(yaml_path), *_argv(overrides, bare_true=False)]
        log = open(workdir / f"machine{machine}.log", "w+b")  # noqa: SIM115 (closed below, after the wait)
        procs.append(subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    try:
        codes = _wait(procs, timeout)
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    output = (workdir / "machine0.log").read_text(errors="replace")
    out = Path(overrides["output_dir"])
    result = Rehearsal(name, codes, output, time.perf_counter() - start, out, probe_dir)
    if (out / "trainer_state.json").is_file():
        result.history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    if (out / "summary.json").is_file():
        result.summary = json.loads((out / "summary.json").read_text())
    if (probe_dir / "probe.json").is_file():
        result.probe = json.loads((probe_dir / "probe.json").read_text())
    return result


def failure_report(result: Rehearsal, lines: int = 60) -> str:
    """The last lines of every machine's log, for assertion messages."""
    logs = sorted(result.probe_dir.parent.glob("machine*.log"))
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) for p in logs)


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def fp32_replay(result: Rehearsal, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The run's optimizer (torch AdamW, its hyperparameters and per-step learning rates as recorded) applied to
    ``dtype`` copies of the initial trainable parameters with the gradients every step received: what the
    run's update is in exact ``dtype`` arithmetic. Returned in float32."""
    record = result.probe
    if record["optimizer"] != "AdamW":
        raise ValueError(f"the replay knows torch AdamW; the run used {record['optimizer']}")
    initial = _load(result.probe_dir / "initial.safetensors")
    params = {n: torch.nn.Parameter(t.to(dtype)) for n, t in initial.items()}
    hyper = record["hyper"]
    optimizer = torch.optim.AdamW(
        params.values(),
        lr=hyper["lr"],
        betas=tuple(hyper["betas"]),
        eps=hyper["eps"],
        weight_decay=hyper["weight_decay"],
        amsgrad=hyper["amsgrad"],
        fused=bool(hyper.get("fused")) and dtype == torch.float32,
    )
    for index, step in enumerate(record["steps"], start=1):
        grads = _load(result.probe_dir / f"grads-{index}.safetensors")
        for name, param in params.items():
            param.grad = grads[name].to(dtype) if name in grads else None
        for group in optimizer.param_groups:
            group["lr"] = step["lr"]
        optimizer.step()
    return {n: p.detach().float() for n, p in params.items()}


def changed_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Fraction of all elements whose value differs between two same-named sets of tensors."""
    changed = sum(int((after[n] != t).sum()) for n, t in before.items())
    return changed / sum(t.numel() for t in before.values())


def initial_and_final(result: Rehearsal) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return _load(result.probe_dir / "initial.safetensors"), _load(result.probe_dir / "final.safetensors")
