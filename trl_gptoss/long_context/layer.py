"""``LongContextDecoderLayer``: a GPT-OSS decoder layer whose token-wise parts run in token tiles and whose
gradient checkpoint can live in host memory; ``enable_long_context(model, ...)`` swaps it in (reversible)."""

from __future__ import annotations

import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer

from trl_gptoss.long_context.offload import CheckpointOffload
from trl_gptoss.long_context.tiles import map_token_tiles


class LongContextDecoderLayer(GptOssDecoderLayer):
    """Same parameters and arithmetic as ``GptOssDecoderLayer``; two options, set by ``enable_long_context``:

    - ``token_tile`` (int or None): ``input_layernorm`` alone, and ``post_attention_layernorm`` + router +
      experts together, run on tiles of this many tokens (``map_token_tiles``), so their saved tensors exist
      for one tile at a time in backward. Attention (its projections, RoPE, sink attention, ``o_proj``) runs on
      the whole sequence and keeps what its backward needs.
    - ``checkpoint_offload`` (a ``CheckpointOffload`` or None): the gradient checkpoint function transformers
      installs (``gradient_checkpointing_enable``) is wrapped so the layer's input goes to host memory.
    """

    token_tile: int | None = None
    checkpoint_offload: CheckpointOffload | None = None

    @property
    def _gradient_checkpointing_func(self):
        inner = self.__dict__.get("_gradient_checkpointing_func")
        if inner is None:
            raise AttributeError("_gradient_checkpointing_func (gradient checkpointing was never enabled)")
        return inner if self.checkpoint_offload is None else self.checkpoint_offload.wrap(inner)

    @_gradient_checkpointing_func.setter
    def _gradient_checkpointing_func(self, function):
        self.__dict__["_gradient_checkpointing_func"] = function

    def _token_wise_mlp(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``post_attention_layernorm`` → router → experts on ``[1, n, H]`` rows (the layer's MLP half)."""
        out, _ = self.mlp(self.post_attention_layernorm(hidden_states))
        return out

    def _token_wise(self, fn, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.token_tile is None:
            return fn(hidden_states)
        return map_token_tiles(fn, hidden_states, self.token_tile)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        normed = self._token_wise(self.input_layernorm, hidden_states)
        attention, _ = self.self_attn(
            hidden_states=normed,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + attention
        return hidden_states + self._token_wise(self._token_wise_mlp, hidden_states)
