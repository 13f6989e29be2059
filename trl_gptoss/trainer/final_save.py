"""The trained model in ``output_dir`` when FSDP checkpoints are sharded (``fsdp_state_dict_type:
SHARDED_STATE_DICT``, every shipped FSDP2 recipe).

transformers' ``Trainer.save_model`` writes weights under FSDP only for ``FULL_STATE_DICT``; with sharded state
dicts it writes nothing, so a job ended with an ``output_dir`` that its summary named as the checkpoint, with a
model card, and neither weights nor config (the recipe rehearsals found it). The checkpoints keep transformers'
``.distcp`` shards, which resuming reads; the final save is gathered here instead, one decoder layer at a time to
rank 0 (``push_layers``), never the whole model in one process:

- a full model as a transformers checkpoint in the dtype it trained in (the fp32 masters under FSDP2 mixed
  precision: most RL updates at lr 1e-6 are below bf16's resolution, so a bf16 copy would drop them); the
  config's ``dtype`` is the widest of them (bf16 weights keep their norms in fp32), so ``dtype="auto"`` loads
  them as saved;
- a PEFT model as its adapter (``adapter_config.json``, ``adapter_model.safetensors``), as TRL saves one.

The save is staged (``staged_save``): everything is written into a fresh directory beside ``output_dir`` and
moved in by rename, so a job re-run or extended into the same ``output_dir`` never leaves the new model's files
beside an earlier one's. A failure while writing (a full disk, a kill: the long part) removes the staging
directory and leaves the earlier model intact and loadable. The install is renames only: the earlier model's
files go first, its config and index before its weights, then the new files come in, config and index last;
a kill in those few milliseconds leaves nothing loadable, never a mix. Checkpoints, logs and anything else in
``output_dir`` stay where they are.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from pathlib import Path

import torch

from trl_gptoss.rollout.processes import pid_alive

# The files a saved model (or adapter) consists of, with the tokenizer's and the training arguments; an earlier
# save's files of these names are removed when a new model is moved in. What says "this is a model" goes first
# on the way out and last on the way in: with it absent, nothing half-installed loads.
_MODEL_FILE = re.compile(
    r"(?:model(?:-\d+-of-\d+|-\d+)?\.safetensors|pytorch_model(?:-\d+-of-\d+)?\.bin|"
    r"(?:model\.safetensors|pytorch_model\.bin)\.index\.json|config\.json|generation_config\.json|"
    r"adapter_config\.json|adapter_model\.(?:safetensors|bin)|training_args\.bin)"
)
_MARKERS = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "config.json", "adapter_config.json")
_STAGING = ".{name}.saving-{pid}-"


def writes_no_weights(trainer) -> bool:
    """Whether transformers' ``save_model`` would leave ``output_dir`` without the trained weights."""
    if not trainer.is_fsdp_enabled:
        return False
    return "FULL_STATE_DICT" not in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)


def save_gathered(trainer, output_dir: str) -> None:
    """Write the trained model (or adapter), its tokenizer and the training arguments to ``output_dir``.
    Collective: every rank calls it; the global main process, which the gathers deliver to, writes."""
    save_trained_model(
        trainer.accelerator.unwrap_model(trainer.model),
        output_dir,
        writer=trainer.accelerator.is_main_process,
        processing_class=trainer.processing_class,
        training_args=trainer.args,
    )


def save_trained_model(model, output_dir, *, writer: bool, processing_class=None, training_args=None) -> None:
    """``save_gathered`` without a trainer: ``model`` (unwrapped; a ``PeftModel`` saves its adapter) staged and
    moved into ``output_dir`` by the ``writer``; every rank calls it (the gathers are collective)."""
    from trl_gptoss.rollout.weights.merged_checkpoint import save_merged_checkpoint

    with staged_save(Path(output_dir), writer) as stage:
        if _is_peft(model):
            _save_adapter(model, stage)
        else:
            save_merged_checkpoint(model, stage, config_dtype=_widest_dtype(model))
        if stage is not None:
            if processing_class is not None:
                processing_class.save_pretrained(stage)
            if training_args is not None:
                torch.save(training_args, stage / "training_args.bin")


@contextlib.contextmanager
def staged_save(target: Path, writer: bool = True):
    """Yields a fresh directory beside ``target`` to write a model into (``None`` where ``writer`` is false), and
    moves its files into ``target`` when the block ends without an exception; with one, it is removed and
    ``target`` is as it was."""
    if not writer:
        yield None
        return
    target = target.absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_stagings(target)
    stage = target.parent / (_STAGING.format(name=target.name, pid=os.getpid()) + secrets.token_hex(4))
    stage.mkdir()
    try:
        yield stage
        _install(stage, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _install(stage: Path, target: Path) -> None:
    """Move the staged files into ``target`` by rename: the earlier model's out first (its markers first), then
    the new files in (markers last)."""
    if not target.exists():
        os.rename(stage, target)  # one rename: all or nothing
        return
    old = [p for p in target.iterdir() if _MODEL_FILE.fullmatch(p.name)]
    new = list(stage.iterdir())
    old_markers_first = sorted(old, key=lambda p: p.name not in _MARKERS)
    new_markers_last = sorted(new, key=lambda p: p.name in _MARKERS)
    for path in old_markers_first:
        _move(path, stage / f".old-{path.name}")
    for path in new_markers_last:
        _move(path, target / path.name)


def _move(source: Path, destination: Path) -> None:
    os.replace(source, destination)


def _remove_dead_stagings(target: Path) -> None:
    """Staging directories an earlier save of ``target`` left when its process was killed."""
    prefix = f".{target.name}.saving-"
    for path in target.parent.glob(prefix + "*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _widest_dtype(model) -> torch.dtype:
    """The widest dtype among the model's parameters: what the config says, so that ``dtype="auto"`` loads every
    saved tensor without rounding (bf16 weights keep their norms in fp32: ``_keep_in_fp32_modules``)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).bits)


def _save_adapter(model, path: Path | None) -> None:
    """PEFT's ``save_pretrained`` from the full trainable tensors (the adapter: the base is frozen), gathered in
    ``named_parameters`` order on every rank (each ``full_tensor`` is a collective)."""
    from torch.distributed.tensor import DTensor

    adapter = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if path is not None:
            adapter[name] = full.detach().to("cpu", copy=True)
        del full
    if path is not None:
        model.save_pretrained(path, state_dict=adapter)
