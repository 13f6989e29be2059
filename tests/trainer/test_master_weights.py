"""bf16/fp16 master weights at a learning rate they cannot represent are refused before the first update.

The defect: a DDP or one-process run with ``dtype: bfloat16`` and a plain torch optimizer trains at the 20B
recipes' lr (1e-6) with almost every update rounded away, while the loss curve looks normal.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.trainer.helpers import grpo_args, length_reward, logged, prompt_dataset
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.trainer import GptOssGRPOTrainer
from trl_gptoss.trainer.master_weights import check_master_weights, half_spacing, rounded_away


def _weights(dtype, seed=0, std=0.02):
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(seed)).mul_(std).to(dtype)


def _fraction_changed_by_adamw(dtype, lr, steps=20):
    weight = torch.nn.Parameter(_weights(dtype))
    start = weight.detach().clone()
    optimizer = torch.optim.AdamW([weight], lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        weight.grad = torch.randn(weight.shape, generator=generator).to(dtype)
        optimizer.step()
    return (weight.detach() != start).float().mean().item()


def test_adamw_on_bf16_weights_keeps_almost_no_update_at_rl_learning_rates():
    """The measurement behind the guard: 20 AdamW steps at lr 1e-6 move ~all fp32 elements, few bf16 ones."""
    assert _fraction_changed_by_adamw(torch.float32, 1e-6) > 0.99
    assert _fraction_changed_by_adamw(torch.bfloat16, 1e-6) < 0.1
    found = rounded_away([_weights(torch.bfloat16)], 1e-6)
    assert found.fraction > 0.9 and found.dtypes == ("bfloat16",)


@pytest.mark.parametrize(
    "dtype, lr, lost_at_least, lost_at_most",
    [
        (torch.bfloat16, 1e-6, 0.9, 1.0),
        (torch.bfloat16, 1e-2, 0.0, 0.0),
        (torch.float16, 1e-6, 0.3, 1.0),
        (torch.float16, 1e-3, 0.0, 0.0),
        (torch.float32, 1e-8, 0.0, 0.0),
    ],
    ids=["bf16-1e-6", "bf16-1e-2", "fp16-1e-6", "fp16-1e-3", "fp32-1e-8"],
)
def test_the_count_follows_the_dtype_and_lr(dtype, lr, lost_at_least, lost_at_most):
    found = rounded_away([_weights(dtype)], lr)
    if dtype == torch.float32:
        assert found.total == 0  # fp32 masters are never counted
        return
    assert lost_at_least <= found.fraction <= lost_at_most


def test_half_spacing_is_the_largest_step_that_rounds_back():
    for dtype in (torch.bfloat16, torch.float16):
        half = half_spacing(0.01, dtype)
        w = torch.tensor(0.01, dtype=dtype)
        assert (w.float() + 0.9 * half).to(dtype) == w
        assert (w.float() + 1.1 * half).to(dtype) != w


def test_refusal_names_the_numbers_and_the_fixes():
    weight = torch.nn.Parameter(_weights(torch.bfloat16))
    with pytest.raises(ValueError) as info:
        check_master_weights(torch.optim.AdamW([weight], lr=1e-6))
    message = str(info.value)
    for expected in ("lr=1e-06", "bfloat16", "FSDP2", "mixed_precision: bf16", "dtype: float32", "bf16: true"):
        assert expected in message, expected


def test_a_warm_up_schedule_is_judged_by_its_peak_lr():
    weight = torch.nn.Parameter(_weights(torch.bfloat16))
    optimizer = torch.optim.AdamW([weight], lr=1e-6)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0)  # lr 0 at step 0, initial_lr kept
    assert optimizer.param_groups[0]["lr"] == 0.0
    with pytest.raises(ValueError, match="lr=1e-06"):
        check_master_weights(optimizer)


def test_a_partial_loss_warns_and_fp32_or_other_optimizers_pass(caplog):
    weights = _weights(torch.bfloat16)
    weights.view(-1)[::10] = 4.0  # every 10th element: half the bf16 spacing at 4 is 0.0156 > lr
    with caplog.at_level(logging.WARNING):
        found = check_master_weights(torch.optim.SGD([torch.nn.Parameter(weights)], lr=1e-3))
    assert abs(found.fraction - 0.1) < 0.01
    assert "10.0% of the trainable bfloat16 weights" in caplog.text
    assert check_master_weights(torch.optim.AdamW([torch.nn.Parameter(_weights(torch.float32))], lr=1e-9)) is None

    class KahanAdamW(torch.optim.Optimizer):  # an optimizer outside torch.optim may keep its own fp32 copy
        __module__ = "my_optimizers"

        def __init__(self, params):
            super().__init__(params, {"lr": 1e-6})

    assert check_master_weights(KahanAdamW([torch.nn.Parameter(_weights(torch.bfloat16))])) is None


def _bf16_trainer(tokenizer, tmp_path, learning_rate):
    return GptOssGRPOTrainer(
        tiny_gpt_oss(seed=0, dtype=torch.bfloat16),
        length_reward,
        args=grpo_args(tmp_path, max_completion_length=16, max_steps=1, learning_rate=learning_rate),
        train_dataset=prompt_dataset([0, 1]),
        processing_class=tokenizer,
        tools=[],
    )


def test_trainer_refuses_bf16_masters_at_the_recipes_lr_before_any_update(tokenizer, tmp_path):
    trainer = _bf16_trainer(tokenizer, tmp_path, learning_rate=1e-6)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match=r"do not move by a step of lr=1e-06"):
        trainer.train()
    assert trainer.state.global_step == 0
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), before[name]), f"{name} changed before the refusal"
    trainer.close()


def test_trainer_trains_bf16_masters_at_an_lr_they_represent(tokenizer, tmp_path):
    trainer = _bf16_trainer(tokenizer, tmp_path, learning_rate=1e-2)
    trainer.train()
    assert logged(trainer, "loss") and trainer.state.global_step == 1
    trainer.close()
