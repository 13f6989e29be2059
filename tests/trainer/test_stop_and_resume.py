"""``GptOssGRPOTrainer`` used as a library stops and resumes as the job does: SIGTERM stops ``train()`` as Ctrl-C
does, a checkpoint cut off during its save (or otherwise not whole) is never resumed from and the file at fault
is named, a resumed state past ``max_steps`` is refused instead of training nothing and ending as a success."""

import json
import logging
import os
import signal
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import TrainerCallback

from tests.trainer.helpers import grpo_args, length_reward, prompt_dataset
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.trainer import GptOssGRPOTrainer
from trl_gptoss.trainer.resume import Terminated, _inside_train, checkpoint_problem


def _whole_checkpoint(path, step=3):
    path.mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, path / "model.safetensors")
    torch.save({"python": (3, tuple(range(625)), None), "cpu": torch.get_rng_state()}, path / "rng_state.pth")
    torch.save({"state": {}, "param_groups": []}, path / "optimizer.pt")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": [{"loss": 0.5}]}))
    return path


def _state(path, **changes):
    state = json.loads((path / "trainer_state.json").read_text())
    state.update(changes)
    (path / "trainer_state.json").write_text(json.dumps(state))


def _truncate(file, keep=0.5):
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


# (id, how the whole checkpoint is damaged, the file the reason names, what it says)
DAMAGES = [
    ("global-step-text", lambda p: _state(p, global_step="abc"), "trainer_state.json", "global_step"),
    ("global-step-negative", lambda p: _state(p, global_step=-5), "trainer_state.json", "global_step"),
    ("global-step-float", lambda p: _state(p, global_step=1.5), "trainer_state.json", "global_step"),
    ("global-step-bool", lambda p: _state(p, global_step=True), "trainer_state.json", "global_step"),
    ("global-step-missing", lambda p: _state(p, global_step=None), "trainer_state.json", "global_step"),
    ("log-history-text", lambda p: _state(p, log_history="abc"), "trainer_state.json", "log_history"),
    ("log-history-numbers", lambda p: _state(p, log_history=[1, 2]), "trainer_state.json", "log_history"),
    ("unknown-state-field", lambda p: _state(p, globl_step=3), "trainer_state.json", "globl_step"),
    ("state-a-list", lambda p: (p / "trainer_state.json").write_text("[3]"), "trainer_state.json", "list"),
    ("state-cut-off", lambda p: _truncate(p / "trainer_state.json"), "trainer_state.json", "not valid JSON"),
    ("state-missing", lambda p: (p / "trainer_state.json").unlink(), "trainer_state.json", "missing"),
    ("rng-state-truncated", lambda p: _truncate(p / "rng_state.pth"), "rng_state.pth", "truncated"),
    ("rng-state-not-torch", lambda p: (p / "rng_state.pth").write_text("{}"), "rng_state.pth", "truncated"),
    ("optimizer-truncated", lambda p: _truncate(p / "optimizer.pt", 0.9), "optimizer.pt", "truncated"),
    ("weights-truncated", lambda p: _truncate(p / "model.safetensors", 0.9), "model.safetensors", "truncated"),
]


@pytest.mark.parametrize("damage, file, says", [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES])
def test_a_checkpoint_that_is_not_whole_is_named_with_the_file_at_fault(tmp_path, damage, file, says):
    checkpoint = _whole_checkpoint(tmp_path / "checkpoint-3")
    assert checkpoint_problem(checkpoint) is None
    damage(checkpoint)
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and str(checkpoint / file) in problem and says in problem, problem


def _trainer(tokenizer, out, **overrides):
    args = grpo_args(out, **{"max_completion_length": 16, "save_strategy": "steps", "save_steps": 1, **overrides})
    return GptOssGRPOTrainer(
        tiny_gpt_oss(seed=0),
        length_reward,
        args=args,
        train_dataset=prompt_dataset([0, 1]),
        processing_class=tokenizer,
        tools=[],
    )


def test_resume_skips_a_damaged_checkpoint_and_refuses_one_past_max_steps(tokenizer, tmp_path, caplog):
    out = tmp_path / "run"
    _trainer(tokenizer, out).train()
    _truncate(out / "checkpoint-2" / "rng_state.pth")  # what a stop in the middle of its write leaves
    with caplog.at_level(logging.WARNING, logger="trl_gptoss.trainer.resume"):
        resumed = _trainer(tokenizer, out)
    assert str(out / "checkpoint-2" / "rng_state.pth") in caplog.text, caplog.text
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == [
        "checkpoint-1",
        "incomplete-checkpoint-2",
    ]
    resumed.train(resume_from_checkpoint=True)  # the newest whole checkpoint: step 1, so step 2 trains again
    assert [h["step"] for h in resumed.state.log_history if "loss" in h] == [1, 2]  # step 1's record: resumed
    assert checkpoint_problem(out / "checkpoint-2") is None  # written again, whole

    _state(out / "checkpoint-1", global_step=10**9)  # trained 0 steps and exited 0
    with pytest.raises(ValueError, match="global_step=1000000000, beyond max_steps=2"):
        _trainer(tokenizer, out).train(resume_from_checkpoint=str(out / "checkpoint-1"))


def test_sigterm_stops_train_as_ctrl_c_does(tokenizer, tmp_path):
    """The signal is sent from the hook after checkpoint-1's save, on the main thread: it lands at that moment,
    every time."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a process that set none

    class TerminateAfterStep1(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            handler = signal.getsignal(signal.SIGTERM)
            assert handler not in (signal.SIG_DFL, None), "train() left SIGTERM's default action: it would kill"
            assert _inside_train(sys._getframe())
            os.kill(os.getpid(), signal.SIGTERM)

    trainer = _trainer(tokenizer, tmp_path / "run", max_steps=3)
    trainer.add_callback(TerminateAfterStep1())
    try:
        with pytest.raises(Terminated):
            trainer.train()
        assert trainer.state.global_step == 1 and checkpoint_problem(tmp_path / "run" / "checkpoint-1") is None
        # no hook runs after an exception: the handler outlives train(), and there gives the default action
        assert not _inside_train(sys._getframe())
    finally:
        signal.signal(signal.SIGTERM, previous)
        trainer.close()


def test_train_puts_the_default_sigterm_action_back_and_keeps_an_applications_handler(tokenizer, tmp_path):
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    seen = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(signal.getsignal(signal.SIGTERM))

    def application(signum, frame):
        pass

    trainer = _trainer(tokenizer, tmp_path / "run", max_steps=1, save_strategy="no")
    trainer.add_callback(Record())
    try:
        trainer.train()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and seen[-1] not in (signal.SIG_DFL, None)
        signal.signal(signal.SIGTERM, application)
        trainer.train()
        assert seen[-1] is application and signal.getsignal(signal.SIGTERM) is application
    finally:
        signal.signal(signal.SIGTERM, previous)
        trainer.close()


def test_a_handler_that_outlived_its_train_gives_sigterm_the_default_action(tmp_path):
    """A ``train()`` that ended by an exception never reaches ``on_train_end``: outside ``train()`` the handler
    it left must end the process as SIGTERM's default action does, not raise ``Terminated`` wherever it lands."""
    import subprocess

    code = f"""
import os, signal
from transformers import TrainerState
from trl_gptoss.trainer import GptOssGRPOConfig
from trl_gptoss.trainer.resume import StopAndResume
args = GptOssGRPOConfig({str(tmp_path)!r}, use_cpu=True, report_to=[])
guard = StopAndResume(args)
guard.on_train_begin(args, TrainerState(global_step=0, max_steps=1), None)  # then train() raised: no end hook
assert signal.getsignal(signal.SIGTERM) == guard._on_sigterm
print("armed", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("survived", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGTERM and done.stdout.split() == ["armed"], (done.stdout, done.stderr[-2000:])
