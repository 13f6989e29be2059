"""The final save is staged: a new model never mixes with an earlier one in the same ``output_dir``.

A job re-run or extended into one ``output_dir`` saves over a finished model. Real saves of tiny models (one
process: the gathers are local), with two faults injected where they happen in production: a full disk at the
second weight file (while writing: the earlier model must stay intact and loadable), and a kill between the
renames that install the new files (nothing may load, never a mix). Checkpoints and logs beside the model stay.
"""

import errno
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from transformers import GptOssForCausalLM

from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.trainer import final_save
from trl_gptoss.trainer.final_save import save_gathered


def _trainer(model, **args):
    """What ``save_gathered`` reads of a trainer, for one process (the main one, which writes)."""
    return SimpleNamespace(
        accelerator=SimpleNamespace(is_main_process=True, unwrap_model=lambda m: m),
        model=model,
        processing_class=None,
        args=args,
    )


def _earlier_run(tmp_path):
    """``output_dir`` holding a finished model of 3 layers, a checkpoint and a log; returns it and the model."""
    out = tmp_path / "out"
    earlier = tiny_gpt_oss(seed=1, num_hidden_layers=3)
    save_gathered(_trainer(earlier, run="earlier"), str(out))
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "trainer_state.json").write_text("{}")
    (out / "README.md").write_text("model card")
    return out, earlier


def _assert_loads_as(out, model):
    loaded = GptOssForCausalLM.from_pretrained(out, dtype="auto")
    assert loaded.config.num_hidden_layers == model.config.num_hidden_layers
    expected = dict(model.named_parameters())
    differ = [n for n, p in loaded.named_parameters() if not torch.equal(p, expected[n])]
    assert differ == [], differ


def _nothing_beside(out):
    left = sorted(p.name for p in out.parent.iterdir() if p.name != out.name)
    assert left == [], f"a staging directory was left beside the output: {left}"


def test_a_save_over_an_earlier_model_replaces_it_whole(tmp_path):
    out, _ = _earlier_run(tmp_path)
    earlier_files = {p.name for p in out.glob("model-*.safetensors")}
    new = tiny_gpt_oss(seed=2, num_hidden_layers=2)
    save_gathered(_trainer(new, run="new"), str(out))
    _assert_loads_as(out, new)
    new_files = {p.name for p in out.glob("model-*.safetensors")}
    assert new_files < earlier_files, "the earlier model's extra weight file was left beside the new model"
    assert torch.load(out / "training_args.bin", weights_only=False) == {"run": "new"}
    assert (out / "checkpoint-4" / "trainer_state.json").is_file() and (out / "README.md").read_text() == "model card"
    _nothing_beside(out)


def test_a_save_failing_at_its_second_weight_file_leaves_the_earlier_model_loadable(tmp_path, monkeypatch):
    out, earlier = _earlier_run(tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    real_save_file, calls = safetensors.torch.save_file, []

    def disk_full_at_the_second(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full_at_the_second)
    with pytest.raises(OSError, match="No space left"):
        save_gathered(_trainer(tiny_gpt_oss(seed=2, num_hidden_layers=2), run="new"), str(out))
    assert len(calls) == 2
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before, "the earlier model's files changed"
    _assert_loads_as(out, earlier)
    _nothing_beside(out)


def test_a_kill_while_the_new_files_move_in_leaves_nothing_loadable(tmp_path, monkeypatch):
    """The install is renames; stopped before the last one (the new index), neither model loads."""
    out, _ = _earlier_run(tmp_path)
    real_move = final_save._move

    def killed_before_the_index(source, destination):
        if destination.name == "model.safetensors.index.json" and destination.parent == out:
            raise KeyboardInterrupt  # where a SIGKILL would stop it: nothing after this runs
        real_move(source, destination)

    monkeypatch.setattr(final_save, "_move", killed_before_the_index)
    new = tiny_gpt_oss(seed=2, num_hidden_layers=2)
    with pytest.raises(KeyboardInterrupt):
        save_gathered(_trainer(new, run="new"), str(out))
    assert not (out / "model.safetensors.index.json").exists()
    with pytest.raises((OSError, ValueError)):
        GptOssForCausalLM.from_pretrained(out, dtype="auto")
    monkeypatch.setattr(final_save, "_move", real_move)
    save_gathered(_trainer(new, run="new"), str(out))  # the next save installs the model whole
    _assert_loads_as(out, new)
    _nothing_beside(out)


class _DiskFullTokenizer:
    def save_pretrained(self, path):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_lora_adapter_is_staged_too(tmp_path):
    from peft import PeftModel, get_peft_model

    from tests.trainer.helpers import lora_config

    out = tmp_path / "out"

    def adapter(seed):
        model = get_peft_model(tiny_gpt_oss(seed=0), lora_config())
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_()
        return model

    earlier, new = adapter(1), adapter(2)
    save_gathered(_trainer(earlier, run="earlier"), str(out))
    failing = _trainer(new, run="new")
    failing.processing_class = _DiskFullTokenizer()  # fails after the adapter is written (to the staging dir)
    with pytest.raises(OSError, match="No space left"):
        save_gathered(failing, str(out))
    for expected in (earlier, new):
        if expected is new:
            save_gathered(_trainer(new, run="new"), str(out))
        loaded = PeftModel.from_pretrained(tiny_gpt_oss(seed=0), out)
        want = {n: p for n, p in expected.named_parameters() if "lora_" in n}
        got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    _nothing_beside(out)
