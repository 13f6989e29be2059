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
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def writes_no_weights(trainer) -> bool:
    """Whether transformers' ``save_model`` would leave ``output_dir`` without the trained weights."""
    if not trainer.is_fsdp_enabled:
        return False
    return "FULL_STATE_DICT" not in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)


def save_gathered(trainer, output_dir: str) -> None:
    """Write the trained model (or adapter), its tokenizer and the training arguments to ``output_dir``.
    Collective: every rank calls it; the global main process, which the gathers deliver to, writes."""
    from trl_gptoss.rollout.weights.merged_checkpoint import save_merged_checkpoint

    writer = trainer.accelerator.is_main_process
    path = Path(output_dir)
    if writer:
        path.mkdir(parents=True, exist_ok=True)
    model = trainer.accelerator.unwrap_model(trainer.model)
    if _is_peft(model):
        _save_adapter(model, path if writer else None)
    else:
        save_merged_checkpoint(model, path if writer else None, config_dtype=_widest_dtype(model))
    if writer:
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))


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
