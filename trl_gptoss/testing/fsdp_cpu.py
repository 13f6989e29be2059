"""Run accelerate's own FSDP2 preparation on a CPU gloo process group (tests only).

accelerate 1.15 selects ``DistributedType.FSDP`` only for accelerator-backed multi-process types
(``MULTI_GPU``, ``MULTI_XPU``, ...): with ``use_cpu`` the state becomes ``MULTI_CPU`` and the FSDP plugin that
``TrainingArguments(fsdp=..., fsdp_config=...)`` built is dropped, so a CPU test would silently train with DDP.
FSDP2 itself (``torch.distributed.fsdp.fully_shard``) runs on gloo. ``fsdp2_on_cpu()`` keeps that plugin: after
``AcceleratorState`` has chosen ``MULTI_CPU``, it does what accelerate's FSDP branch would have done
(``distributed_type = FSDP`` -- in ``AcceleratorState`` and in the ``PartialState`` it is re-read from by every
later ``AcceleratorState()`` --, ``fsdp_plugin``, and with ``mixed_precision`` bf16/fp16 the plugin's
``set_mixed_precision``, which gives FSDP2 its ``MixedPrecisionPolicy``: parameters cast to the low dtype for
compute, gradients reduced in it, trainable parameters kept as fp32 masters). Everything downstream --
``Accelerator.prepare`` -> ``fsdp2_prepare_model`` (its fp32 upcast of trainable parameters included) ->
``fully_shard``, accelerate's autocast around ``forward`` (``native_amp``, which accelerate enables for bf16 on a
CPU as on a GPU), sharded checkpoints, ``Trainer.is_fsdp_enabled`` -- is unmodified production code. Nothing
outside ``trl_gptoss.testing`` imports this.
"""

from __future__ import annotations

import contextlib
import functools

__all__ = ["fsdp2_on_cpu", "fsdp_args"]


@contextlib.contextmanager
def fsdp2_on_cpu():
    """While active, an ``Accelerator`` created on a CPU multi-process (gloo) world with an FSDP plugin gets
    accelerate's FSDP distributed type instead of ``MULTI_CPU``. Enter it before the trainer is constructed;
    the state is a per-process singleton, so it stays FSDP after the context exits."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    @functools.wraps(original)
    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # what accelerate's own FSDP branch does (state.py), mixed precision included
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            # every later AcceleratorState() re-reads distributed_type from PartialState (accelerate writes it
            # there too at the end of its own __init__)
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init
    try:
        yield
    finally:
        AcceleratorState.__init__ = original


def fsdp_args(state_dict_type: str = "FULL_STATE_DICT", **config) -> dict:
    """``TrainingArguments`` fields for FSDP2 with one ``fully_shard`` unit per GPT-OSS decoder layer (plus the
    root), as the shipped FSDP recipes configure it."""
    fsdp_config = {
        "version": 2,
        "transformer_layer_cls_to_wrap": ["GptOssDecoderLayer"],
        "state_dict_type": state_dict_type,
        "reshard_after_forward": True,
        **config,
    }
    return {"fsdp": True, "fsdp_config": fsdp_config}
