"""Every start sets checkpoints cut off during their save aside before it resumes; ``latest`` then picks the
newest complete one, or starts afresh when there is none."""

import json

import pytest
import torch
from safetensors.torch import save_file

from trl_gptoss.demo.paths import embedded_default_config
from trl_gptoss.scripts.grpo import parse_job_args, resume_checkpoint, set_aside_incomplete_checkpoints


def _checkpoint(root, step, state="complete"):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, path / "model.safetensors")
    if state == "complete":
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    elif state == "truncated":  # killed while the state itself was being written
        (path / "trainer_state.json").write_text('{"global_step": ')
    return path


def _training(out, resume):
    argv = ["--config", str(embedded_default_config()), "--output_dir", str(out), "--rollout_backend", "transformers"]
    return parse_job_args([*argv, "--resume_from_checkpoint", resume])[1]


def test_latest_skips_checkpoints_cut_off_during_their_save(tmp_path):
    out = tmp_path / "run"
    _checkpoint(out, 1)
    _checkpoint(out, 2, state="missing")
    _checkpoint(out, 3, state="truncated")
    (out / "incomplete-checkpoint-2").mkdir()  # a stale one from an earlier interrupted save of step 2
    assert resume_checkpoint(_training(out, "latest")) == str(out / "checkpoint-1")
    names = sorted(p.name for p in out.iterdir())
    assert names == ["checkpoint-1", "incomplete-checkpoint-2", "incomplete-checkpoint-3"], names
    assert (out / "incomplete-checkpoint-2" / "model.safetensors").is_file()  # the newer partial one is kept


def test_latest_without_a_complete_checkpoint_is_a_fresh_start(tmp_path):
    out = tmp_path / "run"
    assert resume_checkpoint(_training(out, "latest")) is None  # no output_dir yet
    _checkpoint(out, 4, state="missing")
    assert resume_checkpoint(_training(out, "latest")) is None
    assert [p.name for p in out.iterdir()] == ["incomplete-checkpoint-4"]


def test_an_explicit_checkpoint_is_used_as_given_and_must_be_whole(tmp_path):
    out = tmp_path / "run"
    whole = _checkpoint(out, 5)
    assert resume_checkpoint(_training(out, str(whole))) == str(whole)
    partial = _checkpoint(out, 6, state="truncated")
    with pytest.raises(
        SystemExit, match="checkpoint-6' cannot be resumed from: .*checkpoint-6/trainer_state.json is not"
    ):
        _training(out, str(partial))


def test_only_checkpoint_directories_are_touched(tmp_path):
    _checkpoint(tmp_path, 7, state="missing")
    (tmp_path / "checkpoint-notes.txt").write_text("mine")
    (tmp_path / "checkpoint-8-backup").mkdir()
    assert set_aside_incomplete_checkpoints(tmp_path) == [tmp_path / "incomplete-checkpoint-7"]
    assert (tmp_path / "checkpoint-notes.txt").is_file() and (tmp_path / "checkpoint-8-backup").is_dir()


def test_the_trainers_rotation_never_counts_a_set_aside_checkpoint(tmp_path):
    from transformers.trainer_utils import rotate_checkpoints

    _checkpoint(tmp_path, 1)
    _checkpoint(tmp_path, 2, state="missing")
    _checkpoint(tmp_path, 3)
    set_aside_incomplete_checkpoints(tmp_path)
    rotate_checkpoints(str(tmp_path), save_total_limit=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "incomplete-checkpoint-2"]


def test_an_explicit_checkpoint_with_a_truncated_rng_state_is_refused_naming_the_file(tmp_path):
    checkpoint = _checkpoint(tmp_path / "run", 5)
    torch.save({"cpu": torch.get_rng_state()}, checkpoint / "rng_state.pth")
    (checkpoint / "rng_state.pth").write_bytes((checkpoint / "rng_state.pth").read_bytes()[:100])
    with pytest.raises(SystemExit, match=f"cannot be resumed from: {checkpoint}/rng_state.pth is truncated"):
        _training(tmp_path / "run", str(checkpoint))


def test_a_checkpoint_past_max_steps_is_refused_not_trained_for_zero_steps(tmp_path):
    out = tmp_path / "run"
    far = _checkpoint(out, 10**9)
    with pytest.raises(SystemExit, match="global_step=1000000000, beyond max_steps=[0-9]+: resuming would train"):
        _training(out, str(far))
    with pytest.raises(SystemExit, match=f"latest picks {far}: the checkpoint is at global_step=1000000000"):
        resume_checkpoint(_training(out, "latest"))
