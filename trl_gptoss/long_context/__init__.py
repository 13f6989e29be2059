"""Long-context memory for GPT-OSS training: token-wise parts of each decoder layer (norms, router, experts)
recomputed in token tiles, and the layers' gradient checkpoints kept in host memory.

``enable_long_context(model, token_tile=..., offload_checkpoints=...)`` switches them on for every decoder
layer (a class swap, same parameters) and returns a handle whose ``revert()`` switches them off; the trainer
calls it from the config fields ``long_context_token_tile`` and ``long_context_offload_checkpoints``.
"""

from __future__ import annotations

from trl_gptoss.long_context.patch import (
    LongContextHandle,
    enable_from_config,
    enable_long_context,
    validate_token_tile,
)

__all__ = ["LongContextHandle", "enable_from_config", "enable_long_context", "validate_token_tile"]
