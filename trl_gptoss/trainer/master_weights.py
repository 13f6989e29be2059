"""Refuse low-precision master weights at a learning rate they cannot represent.

A plain torch optimizer updates a parameter in the parameter's own dtype. Adam's step is about ``lr`` per element
in its first steps (``m / sqrt(v)`` is about +-1), so a bf16 weight ``w`` moves only when ``lr`` exceeds half the
spacing of bf16 numbers around ``w``; below that the update rounds back to ``w``. bf16 keeps 8 significant bits:
at ``|w| = 0.01`` the spacing is 6.1e-5, so at RL learning rates (1e-6) nearly every update of a bf16 model
vanishes while the run logs a normal loss. fp16 (11 bits) loses less but the same way.

Where it does not apply: accelerate's FSDP2 with ``mixed_precision != "no"`` upcasts trainable parameters to fp32
masters (``accelerate/utils/fsdp_utils.py``, "Upcast to fp32 master weights") and computes in bf16 through its
``MixedPrecisionPolicy``; PEFT keeps LoRA adapters in fp32 by default; optimizers outside ``torch.optim`` may keep
their own fp32 copies or round stochastically, so only ``torch.optim`` optimizers are checked.

The check runs once at train begin, after ``accelerator.prepare`` (which is where FSDP2 upcasts), on the
parameters the optimizer really holds, before the first update.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

LOW_PRECISION = (torch.bfloat16, torch.float16)
# Share of elements whose Adam-sized step rounds away: refused from here (the run would barely train) ...
REFUSE_FRACTION = 0.5
# ... and warned from here (a visible part of the model is frozen by rounding).
WARN_FRACTION = 0.01
# Elements inspected per parameter: a strided sample bounds the check's time and memory on 20B models.
SAMPLE_PER_PARAMETER = 1 << 20


@dataclass
class RoundedAway:
    """Of ``total`` sampled low-precision trainable elements, ``lost`` do not move by a step of ``lr``."""

    lost: int
    total: int
    lr: float
    dtypes: tuple[str, ...]
    median_abs: float

    @property
    def fraction(self) -> float:
        return self.lost / self.total if self.total else 0.0

    @classmethod
    def combined(cls, parts: list[RoundedAway]) -> RoundedAway:
        """One count over several parameter groups (the largest lr is quoted: the most favourable one)."""
        counted = [part for part in parts if part.total]
        return cls(
            lost=sum(part.lost for part in parts),
            total=sum(part.total for part in parts),
            lr=max((part.lr for part in counted), default=0.0),
            dtypes=tuple(sorted({dtype for part in parts for dtype in part.dtypes})),
            median_abs=counted[0].median_abs if counted else 0.0,
        )

    def message(self) -> str:
        dtypes = "/".join(self.dtypes) or "low-precision"
        spacing = half_spacing(self.median_abs, getattr(torch, self.dtypes[0])) if self.dtypes else float("nan")
        return (
            f"{100 * self.fraction:.1f}% of the trainable {dtypes} weights ({self.total:,} sampled) do not move "
            f"by a step of lr={self.lr:g}: the optimizer holds them in {dtypes}, where half the spacing between "
            f"representable numbers around a typical weight (|w| = {self.median_abs:.3g}) is {spacing:.2g}, so an "
            "Adam update of about lr rounds back to the old value and training silently stalls. Keep fp32 "
            "master weights: run under FSDP2 with mixed_precision: bf16 (accelerate upcasts trainable parameters "
            "to fp32 and computes in bf16), or load the model in float32 (dtype: float32) and train with "
            "bf16: true (autocast computes in bf16), or train LoRA adapters (fp32 by default). "
            "See docs/scaling.md, 'Master weights'."
        )


def half_spacing(value: float, dtype: torch.dtype) -> float:
    """Half the distance from ``|value|`` to the next representable number of ``dtype`` (the largest step that
    rounds back to it)."""
    magnitude = abs(value) or torch.finfo(dtype).tiny
    return 2.0 ** math.floor(math.log2(magnitude)) * torch.finfo(dtype).eps / 2


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2 DTensor: this rank's shard
    flat = local.detach().reshape(-1)
    stride = max(1, flat.numel() // SAMPLE_PER_PARAMETER)
    return flat[::stride]


def rounded_away(parameters, lr: float) -> RoundedAway:
    """Count the low-precision elements of ``parameters`` that a step of ``+lr`` leaves unchanged (round to
    nearest even, as the optimizer's in-place add does), on a strided sample of each tensor."""
    lost = total = 0
    dtypes, magnitudes = set(), []
    for param in parameters:
        if param.dtype not in LOW_PRECISION:
            continue
        sample = _sample(param)
        lost += int(((sample.float() + lr).to(param.dtype) == sample).sum())
        total += sample.numel()
        dtypes.add(str(param.dtype).removeprefix("torch."))
        magnitudes.append(sample[:4096].float().abs().cpu())
    median = float(torch.cat(magnitudes).median()) if magnitudes else 0.0
    return RoundedAway(lost, total, lr, tuple(sorted(dtypes)), median)


def _plain_torch_optimizer(optimizer) -> torch.optim.Optimizer | None:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    module = type(inner).__module__
    return inner if module == "torch.optim" or module.startswith("torch.optim.") else None


def _peak_lr(group: dict) -> float:
    return float(group.get("initial_lr", group["lr"]))  # schedulers keep the peak there; warm-up starts at 0


def check_master_weights(optimizer, reduce=None) -> RoundedAway | None:
    """Raise ``ValueError`` when most low-precision trainable elements held by a ``torch.optim`` optimizer cannot
    move by one step of its peak learning rate; log a warning when a visible share cannot. ``reduce`` sums a
    float64 tensor over ranks (every rank calls it, so all decide alike). Returns the count, ``None`` when
    nothing applies (another optimizer, or no low-precision trainable parameter)."""
    inner = _plain_torch_optimizer(optimizer)
    if inner is None:
        return None
    found = RoundedAway.combined([rounded_away(g["params"], _peak_lr(g)) for g in inner.param_groups if _peak_lr(g)])
    if reduce is not None:
        counts = reduce(torch.tensor([found.lost, found.total], dtype=torch.float64))
        found.lost, found.total = int(counts[0]), int(counts[1])
    if found.total == 0:
        return None
    if found.fraction >= REFUSE_FRACTION:
        raise ValueError(found.message())
    if found.fraction >= WARN_FRACTION:
        logger.warning(found.message())
    return found


class MasterWeightsGuard(TrainerCallback):
    """``check_master_weights`` on the trainer's prepared optimizer at train begin, before the first update."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator

        def reduce(counts: torch.Tensor) -> torch.Tensor:
            if accelerator.num_processes == 1:
                return counts
            return accelerator.reduce(counts.to(accelerator.device), reduction="sum").cpu()

        check_master_weights(self.trainer.optimizer, reduce)
