"""GptOssGRPOTrainer vs stock TRL GRPOTrainer: optimizer-step time and peak memory of the log-prob loss pass.

Cases (each in a fresh subprocess, one thread, so timings and peak RSS are its own):

- ``step:ours`` / ``step:stock``: the same tiny GPT-OSS (fa3_sink attention, gptoss_sequential experts), the same
  prompts, 4 prompts x 4 generations per step, 32 new tokens, in-process generation, no tools. Ours samples through
  ``run_rollouts`` + ``TransformersEngine`` and computes rollout correction + mismatch metrics; stock samples with
  ``model.generate``. Time = TRL's own ``step_time`` metric (generation + scoring + loss + backward + optimizer),
  median of steps 2..N; the cases alternate 3 times and the best run of each is kept (shared machine).
  Verified first: losses finite, ours logs ``policy/ratio_max_abs_dev == 0``.
- ``logps:ours`` / ``logps:stock``: one loss pass (forward + backward of ``_compute_loss``) at a long completion
  with the real o200k vocabulary size (201,088), tiny body. Peak = VmHWM - VmRSS around the pass
  (``/proc/self/clear_refs`` resets the high-water mark). Verified first: with engine log-probs equal to the
  trainer's, ours computes the same loss as stock (the correction weights are all 1).

Usage: ``python benchmarks/bench_trainer.py [--quick] [--out benchmarks/results/trainer_cpu.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB_201K = 201088
REPEATS = 3


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _dataset(n: int):
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {i} plus {i + 3}?"}]} for i in range(n)]
    )


def _reward(completions, **kwargs):
    def text(c):
        return c[0]["content"] if isinstance(c, list) else c

    return [float(len(text(c)) % 7) for c in completions]


def _model(vocab_size: int | None = None):
    import trl_gptoss  # noqa: F401
    from trl_gptoss.testing import tiny_gpt_oss

    overrides = {"vocab_size": vocab_size} if vocab_size else {}
    model = tiny_gpt_oss(seed=0, **overrides)
    model.set_attn_implementation("fa3_sink")
    model.set_experts_implementation("gptoss_sequential")
    return model


def _args(kind: str, out: str, **fields):
    from trl import GRPOConfig

    from trl_gptoss.trainer import GptOssGRPOConfig

    common = dict(
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=16,
        num_generations=4,
        report_to=[],
        max_completion_length=32,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        temperature=1.0,
        gradient_checkpointing=False,
        router_aux_loss_coef=0.0,
    )
    common.update(fields)
    if kind == "ours":
        return GptOssGRPOConfig(out, rollout_backend="transformers", **common)
    return GRPOConfig(out, **common)


def _trainer(kind: str, model, args, dataset, tokenizer):
    from trl import GRPOTrainer

    from trl_gptoss.trainer import GptOssGRPOTrainer

    if kind == "ours":
        return GptOssGRPOTrainer(model, _reward, args=args, train_dataset=dataset, processing_class=tokenizer, tools=[])
    # stock GRPO renders conversational prompts with the chat template; give it the same Harmony prompts as text
    from trl_gptoss.harmony import render_conversation

    rendered = dataset.map(
        lambda row: {
            "prompt": tokenizer.decode(render_conversation(row["prompt"], tokenizer, add_generation_prompt=True))
        }
    )
    return GRPOTrainer(model, _reward, args=args, train_dataset=rendered, processing_class=tokenizer)


def run_step_case(kind: str, steps: int, out: str) -> dict:
    from trl_gptoss.testing import harmony_tokenizer

    trainer = _trainer(kind, _model(), _args(kind, out, max_steps=steps), _dataset(32), harmony_tokenizer(small=True))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "step_time" in h]
    assert all(h["loss"] == h["loss"] for h in logs), "non-finite loss"
    if kind == "ours":
        assert all(h["policy/ratio_max_abs_dev"] == 0.0 for h in logs)
    times = [h["step_time"] for h in logs[1:]]
    return {
        "step_time_median_s": statistics.median(times),
        "step_time_min_s": min(times),
        "steps": len(times),
        "completion_mean_length": statistics.mean(h["completions/mean_length"] for h in logs),
    }


def run_logps_case(kind: str, completion: int, out: str) -> dict:
    import torch

    from trl_gptoss.testing import harmony_tokenizer

    torch.manual_seed(0)
    model = _model(VOCAB_201K)
    trainer = _trainer(
        kind,
        model,
        _args(kind, out, max_steps=1, per_device_train_batch_size=4),
        _dataset(4),
        harmony_tokenizer(small=True),
    )
    prompt, ids = torch.randint(10, 500, (1, 64)), torch.randint(10, 500, (1, completion))
    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": ids,
        "completion_mask": torch.ones_like(ids),
        "advantages": torch.tensor([1.0]),
        "num_items_in_batch": torch.tensor(float(completion)),
    }
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    if kind == "ours":  # engine log-probs = trainer's: every correction weight is 1, the loss equals stock's
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([prompt, ids], 1), torch.ones(1, 64 + completion, dtype=torch.long), completion
            )
        inputs["sampling_per_token_logps"] = logps
    base = _rss_kib("VmRSS")
    _reset_peak()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    peak = _rss_kib("VmHWM") - base
    return {"loss": loss.item(), "peak_mib": peak / 1024, "completion_tokens": completion, "vocab": VOCAB_201K}


def _subprocess(case: str, arg: int) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    done = subprocess.run(
        [sys.executable, __file__, "--case", case, "--arg", str(arg)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode:
        raise RuntimeError(f"case {case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--case")
    parser.add_argument("--arg", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/trainer_cpu.json"))
    cli = parser.parse_args()
    if cli.case:
        import tempfile

        import torch

        torch.set_num_threads(1)
        kind, what = cli.case.split(":")[1], cli.case.split(":")[0]
        with tempfile.TemporaryDirectory() as out:
            result = run_step_case(kind, cli.arg, out) if what == "step" else run_logps_case(kind, cli.arg, out)
        print(json.dumps(result))
        return
    steps, completion = (4, 1024) if cli.quick else (8, 4096)
    # the machine is shared: alternate the step cases and keep the best median of each (least disturbed)
    runs = {"ours": [], "stock": []}
    for _ in range(REPEATS):
        for kind in runs:
            runs[kind].append(_subprocess(f"step:{kind}", steps))
    results = {
        f"step:{kind}": min(reps, key=lambda r: r["step_time_median_s"])
        | {"step_time_median_of_runs_s": statistics.median(r["step_time_median_s"] for r in reps)}
        for kind, reps in runs.items()
    }
    results.update({f"logps:{kind}": _subprocess(f"logps:{kind}", completion) for kind in ("ours", "stock")})
    ours, stock = results["logps:ours"], results["logps:stock"]
    if abs(ours["loss"] - stock["loss"]) > 1e-4 * max(1.0, abs(stock["loss"])):
        raise RuntimeError(f"loss differs: ours {ours['loss']} vs stock {stock['loss']}")
    ratio = results["step:ours"]["step_time_median_s"] / results["step:stock"]["step_time_median_s"]
    summary = {
        "step_time_ratio_ours_over_stock": ratio,
        "logps_peak_ratio_ours_over_stock": ours["peak_mib"] / stock["peak_mib"],
    }
    print(f"{'case':<14}{'result':>60}")
    for name, value in results.items():
        print(f"{name:<14}{json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in value.items()}):>60}")
    print(json.dumps(summary))
    Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cli.out).write_text(
        json.dumps(
            {"machine": platform.processor() or platform.machine(), "threads": 1, "cases": results, "summary": summary},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
