"""The config fields reach the model: a GRPO step of the trainer with tiles and offloaded checkpoints (tiny
GPT-OSS, in-process engine, CPU) swaps every decoder layer and moves every layer's checkpoint."""

from __future__ import annotations

from tests.long_context.helpers import NUM_LAYERS
from tests.trainer.helpers import grpo_args, prompt_dataset
from trl_gptoss.long_context.layer import LongContextDecoderLayer
from trl_gptoss.testing import harmony_tokenizer, tiny_gpt_oss
from trl_gptoss.trainer import GptOssGRPOTrainer


def reward_length(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


def test_a_training_step_with_tiles_and_offloaded_checkpoints(tmp_path):
    args = grpo_args(
        tmp_path,
        max_steps=1,
        max_completion_length=24,
        gradient_checkpointing=True,
        long_context_token_tile=7,
        long_context_offload_checkpoints=True,
    )
    model = tiny_gpt_oss(attn_implementation="fa3_sink", num_hidden_layers=NUM_LAYERS)
    trainer = GptOssGRPOTrainer(
        model,
        reward_length,
        args=args,
        train_dataset=prompt_dataset([0, 1]),
        processing_class=harmony_tokenizer(small=True),
        tools=[],
    )
    layers = [m for m in trainer.model.modules() if isinstance(m, LongContextDecoderLayer)]
    assert len(layers) == NUM_LAYERS and all(layer.token_tile == 7 for layer in layers)
    trainer.train()
    assert trainer.state.global_step == 1
    assert trainer.long_context.offload.offloaded >= NUM_LAYERS  # every layer's input, at least once
    assert trainer.long_context.offload.peak_device_inputs <= 2
