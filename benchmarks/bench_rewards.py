"""Reward cost on worst-case completions: every reward, every hostile input, 100 kB where size matters.

Usage: ``python benchmarks/bench_rewards.py [--repeats 5] [--out benchmarks/results/rewards.json]``

Workloads (each verified before it is timed: every reward must return floats, and three known answers
must score as expected, so a reward that "got fast" by breaking is caught):
- the hostile corpus of ``trl_gptoss/testing/hostile_completions.py`` (crashes and stalls of earlier versions);
- padded: each corpus entry repeated up to 100 kB, the size the target is stated for;
- a realistic 100 kB ReTool completion (reasoning text, code, a boxed answer at the end).
Per input: the median over ``--repeats`` of each reward's time for ONE completion (ReTool and GSM8K
against one truth; VerifyIf with one constraint of every kind, so every checker runs). Target: <= 50 ms.
Both wall time and this process's CPU time are recorded: on a shared, oversubscribed host (the load
average is recorded too) wall time mostly measures waiting for a core, CPU time what the reward costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from trl_gptoss.rewards import gsm8k_reward, retool_reward, verifyif_reward
from trl_gptoss.testing.hostile_completions import ALL_CONSTRAINTS, CRASHES_AND_STALLS

TARGET_MS = 50.0
SIZE = 100 * 1024
REWARDS = {
    "retool": lambda c: retool_reward([c], answer=["1170"]),
    "gsm8k": lambda c: gsm8k_reward([c], answer=["#### 1170"]),
    "verifyif": lambda c: verifyif_reward([c], constraints=[ALL_CONSTRAINTS]),
}


def _realistic(size: int) -> str:
    step = (
        "We need the sum of the divisors of 360 = 2^3 * 3^2 * 5. Let me check with python.\n"
        "```python\nprint(sum(d for d in range(1, 361) if 360 % d == 0))\n```\nThe tool printed 1170.\n\n"
    )
    return (step * (size // len(step) + 1))[:size] + "\nSo the answer is \\boxed{1170}."


def _verify() -> None:
    assert retool_reward(["so \\boxed{1,170}"], answer=["1170"]) == [1.0]
    assert gsm8k_reward(["#### 1170"], answer=["#### 1170"]) == [1.0]
    assert verifyif_reward(["all lower"], constraints=[[{"type": "all_lowercase"}]]) == [1.0]


def _median_ms(fn, completion: str, repeats: int) -> tuple[float, float]:
    """``(wall, cpu)`` median milliseconds of one call."""
    out = fn(completion)
    assert all(isinstance(r, float) for r in out), out
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn(completion)
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "rewards.json"))
    args = parser.parse_args()
    _verify()
    inputs = {name: text for name, text in CRASHES_AND_STALLS.items()}
    inputs.update(
        {f"{name} x100kB": (text * (SIZE // max(len(text), 1) + 1))[:SIZE] for name, text in CRASHES_AND_STALLS.items()}
    )
    inputs["realistic-retool-100kB"] = _realistic(SIZE)
    rows = []
    load_before = os.getloadavg()[0]
    header = " ".join(f"{name + ' wall/cpu':>20s}" for name in REWARDS)
    print(f"{'input':36s} {'chars':>7s} {header}   (ms, median of {args.repeats})")
    for name, text in inputs.items():
        times = {reward: _median_ms(fn, text, args.repeats) for reward, fn in REWARDS.items()}
        rows.append(
            {
                "input": name,
                "chars": len(text),
                "wall_ms": {r: w for r, (w, _) in times.items()},
                "cpu_ms": {r: c for r, (_, c) in times.items()},
            }
        )
        print(f"{name:36s} {len(text):7d} " + " ".join(f"{w:10.2f}/{c:9.2f}" for w, c in times.values()))
    worst = {kind: {r: max(row[kind][r] for row in rows) for r in REWARDS} for kind in ("wall_ms", "cpu_ms")}
    for kind, per_reward in worst.items():
        listed = ", ".join(f"{r} {v:.2f}" for r, v in per_reward.items())
        print(f"worst {kind}: {listed} (target <= {TARGET_MS:.0f})")
    result = {
        "benchmark": "rewards",
        "host": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_1min": [load_before, os.getloadavg()[0]],
        },
        "repeats": args.repeats,
        "target_ms": TARGET_MS,
        "worst": worst,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
