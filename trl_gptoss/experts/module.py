"""``GptOssSequentialExperts`` (drop-in module), ``patch_gpt_oss_experts`` (reversible swap) and the
``ExpertsInterface`` entry (``experts_implementation="gptoss_sequential"``), all calling
``gptoss_kernels.experts.sequential_experts``."""

from __future__ import annotations

import torch
from transformers.integrations.moe import ExpertsInterface
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from gptoss_kernels.experts import ExpertParams, sequential_experts
from trl_gptoss import SEQUENTIAL_EXPERTS

# Rows per matmul: at 1024 a slice's gathered input and pre-activations stay small next to the [T, H] output,
# at no cost in time (measured in docs/experts.md, "Targets from the issue").
DEFAULT_ROWS_PER_CHUNK = 1024


def sequential_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``ExpertsInterface`` entry for any ``GptOssExperts``-shaped module: ``hidden_states [T, H]`` → ``[T, H]``."""
    return sequential_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        ExpertParams.of(self),
        alpha=self.alpha,
        limit=self.limit,
        rows_per_chunk=getattr(self, "rows_per_chunk", DEFAULT_ROWS_PER_CHUNK),
        layer_name=getattr(self, "layer_name", type(self).__name__),
    )


class GptOssSequentialExperts(GptOssExperts):
    """Drop-in ``GptOssExperts``: same parameters (``gate_up_proj [E,H,2I]``, ``gate_up_proj_bias [E,2I]``,
    ``down_proj [E,I,H]``, ``down_proj_bias [E,H]``), same ``forward(hidden_states, router_indices,
    routing_weights)``, always the sequential path (no per-mode dispatch), so checkpoints, PEFT, FSDP and
    ``save_pretrained`` see an ordinary ``GptOssExperts``.

    Attributes: ``rows_per_chunk`` (rows per matmul, bounds eval peak), ``layer_name`` (for error messages).
    """

    rows_per_chunk: int | None = DEFAULT_ROWS_PER_CHUNK
    layer_name: str = "GptOssSequentialExperts"

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_indices: torch.Tensor | None = None,
        routing_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return sequential_experts_forward(self, hidden_states, router_indices, routing_weights)


class ExpertsPatch:
    """Handle returned by ``patch_gpt_oss_experts``; ``revert()`` (or leaving the ``with`` block) restores
    every swapped module's original class. Parameters are never copied, so optimizer state stays valid."""

    def __init__(self, swapped: list[tuple[torch.nn.Module, type]]):
        self._swapped = swapped

    @property
    def module_names(self) -> list[str]:
        return [module.layer_name for module, _ in self._swapped]

    def revert(self) -> None:
        for module, original_class in self._swapped:
            module.__class__ = original_class
            module.__dict__.pop("layer_name", None)
            module.__dict__.pop("rows_per_chunk", None)
        self._swapped = []

    def __enter__(self) -> ExpertsPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def patch_gpt_oss_experts(
    model: torch.nn.Module, *, rows_per_chunk: int | None = DEFAULT_ROWS_PER_CHUNK
) -> ExpertsPatch:
    """Swap every ``GptOssExperts`` in ``model`` for ``GptOssSequentialExperts`` in place (class swap, same
    module objects and parameters). Returns a handle whose ``revert()`` undoes it.

    Raises ``ValueError`` if the model has no ``GptOssExperts`` or ``rows_per_chunk`` is not a positive int or
    None.
    """
    if rows_per_chunk is not None and (not isinstance(rows_per_chunk, int) or rows_per_chunk <= 0):
        raise ValueError(f"rows_per_chunk must be a positive int or None, got {rows_per_chunk!r}")
    swapped = []
    for name, module in model.named_modules():
        if isinstance(module, GptOssExperts) and not isinstance(module, GptOssSequentialExperts):
            swapped.append((module, type(module)))
            module.__class__ = GptOssSequentialExperts
            module.layer_name = name or "experts"
            module.rows_per_chunk = rows_per_chunk
    if not swapped:
        raise ValueError(
            f"{type(model).__name__} has no GptOssExperts module to patch (already patched, or not a GPT-OSS model)"
        )
    return ExpertsPatch(swapped)


def register_sequential_experts(name: str = SEQUENTIAL_EXPERTS) -> str:
    """Register ``sequential_experts_forward`` globally with transformers' ``ExpertsInterface`` as ``name``,
    so ``from_pretrained(..., experts_implementation=name)`` and ``model.set_experts_implementation(name)``
    work. ``import trl_gptoss`` already does this for ``"gptoss_sequential"``."""
    ExpertsInterface.register(name, sequential_experts_forward)
    return name
