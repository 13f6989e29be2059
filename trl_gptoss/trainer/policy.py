"""Loading (or switching) the policy to the configured attention and experts implementations.

The implementations are applied to the policy only: TRL also loads reward models by id with
``args.model_init_kwargs``, and a Qwen2 reward model must not get ``fa3_sink``.
"""

from __future__ import annotations

import contextlib
import logging

from transformers import AutoConfig

from trl_gptoss.trainer.config import UNSET_AUX_COEF, GptOssGRPOConfig

logger = logging.getLogger(__name__)


def load_policy(model, args: GptOssGRPOConfig):
    """A model id/path is loaded here with ``args.model_init_kwargs`` plus the implementations (TRL's loader,
    TRL's defaults); a model object is switched to them."""
    if isinstance(model, str):
        from trl.trainer.utils import create_model_from_path

        init = dict(args.model_init_kwargs or {})
        init.setdefault("attn_implementation", args.attn_implementation)
        init.setdefault("experts_implementation", args.experts_implementation)
        if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
            init["device_map"] = None  # TRL's rule: "auto" fails under distributed training
        init.setdefault("trust_remote_code", args.trust_remote_code)
        return create_model_from_path(model, **init)
    switch_implementations(model, args)
    return model


def switch_implementations(model, args: GptOssGRPOConfig) -> None:
    """The configured attention and experts implementations on ``model`` (nothing for None)."""
    if model is None:
        return
    if model.config._attn_implementation != args.attn_implementation:
        model.set_attn_implementation(args.attn_implementation)
    if getattr(model.config, "_experts_implementation", None) != args.experts_implementation:
        model.set_experts_implementation(args.experts_implementation)


@contextlib.contextmanager
def model_init_warning_dropped():
    """Around ``GRPOTrainer.__init__``: without TRL's warning that ``model_init_kwargs`` are ignored."""
    from trl import GRPOTrainer

    trl_logger = logging.getLogger(GRPOTrainer.__module__)
    quiet = DropLoadedModelWarning()
    trl_logger.addFilter(quiet)
    try:
        yield
    finally:
        trl_logger.removeFilter(quiet)


class DropLoadedModelWarning(logging.Filter):
    """TRL warns that ``model_init_kwargs`` are ignored for a model object; here the policy *was* loaded with
    them (by ``load_policy``) and reward models still use them, so the warning would be false."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "model_init_kwargs" not in record.getMessage()


def resolve_aux_coef(args: GptOssGRPOConfig, model) -> None:
    """Default 0.0: GPT-OSS checkpoints declare 0.9, which TRL would otherwise add to the RL loss."""
    if args.router_aux_loss_coef is not UNSET_AUX_COEF:
        return
    config = AutoConfig.from_pretrained(model) if isinstance(model, str) else model.config
    declared = getattr(config.get_text_config(), "router_aux_loss_coef", None)
    if declared:
        logger.warning(
            "the checkpoint declares router_aux_loss_coef=%s; trl-gptoss trains with 0.0 (no "
            "load-balancing loss in RL). Set router_aux_loss_coef explicitly to use it.",
            declared,
        )
    args.router_aux_loss_coef = 0.0
