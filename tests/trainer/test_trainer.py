"""GptOssGRPOTrainer with the in-process engine: on-policy ratio, off-policy, R3, correction in the loss."""

import math

import pytest
import torch

from tests.trainer.helpers import grpo_args, length_reward, logged, prompt_dataset
from trl_gptoss.experts.routing import record_routing
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.trainer import GptOssGRPOTrainer


def _trainer(tokenizer, tmp_path, **overrides):
    args = grpo_args(tmp_path, max_completion_length=24, **overrides)
    return GptOssGRPOTrainer(
        tiny_gpt_oss(seed=0),
        length_reward,
        args=args,
        train_dataset=prompt_dataset([0, 1]),
        processing_class=tokenizer,
        tools=[],
    )


def test_on_policy_ratio_is_exactly_one_without_an_old_logprob_pass(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, learning_rate=1e-2)
    old_passes = []
    original = trainer._get_per_token_logps_and_entropies

    def spy(*args, **kwargs):
        if trainer._loss_pass is None:
            old_passes.append(1)
        return original(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = spy
    trainer.train()
    assert logged(trainer, "policy/ratio_max_abs_dev") == [0.0, 0.0]
    assert old_passes == []  # no extra forward when strictly on-policy
    assert max(logged(trainer, "rollout_corr/abs_logp_diff_max")) <= 1e-4  # in-process engine, same model


def test_off_policy_second_iteration_sees_the_update(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, num_iterations=2, learning_rate=1e-2)
    trainer.train()
    first, second = logged(trainer, "policy/ratio_max_abs_dev")
    assert first <= 1e-5  # old log-probs of the same weights (another pass: not bitwise)
    assert second > 1e-4  # after one optimizer step the ratio moved


def test_routing_replay_routes_the_loss_pass_as_recorded(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, num_iterations=2, routing_replay=True, max_steps=2)
    checks = []
    replay = trainer.routing_replay.replay

    class ReplayAndCompare:
        def __init__(self, model, indices):
            self.inner, self.model, self.indices = replay(model, indices), model, indices

        def __enter__(self):
            self.inner.__enter__()
            self.recorder = record_routing(self.model)  # runs after the replay hook: sees what was used
            self.record = self.recorder.__enter__()

        def __exit__(self, *exc):
            self.recorder.__exit__(*exc)
            self.inner.__exit__(*exc)
            rows, length = self.indices.shape[:2]
            used = torch.stack([t.view(rows, length, -1) for t in self.record.indices], dim=2)
            checks.append(torch.equal(used, self.indices))

    trainer.routing_replay.replay = ReplayAndCompare
    trainer.train()
    assert checks == [True, True]


PRESET_WEIGHTS = {  # weight of each token given its log r, from the definitions (upper 2, lower 1/2 for masks)
    "none": lambda lr, row: [1.0] * len(lr),
    "token_tis": lambda lr, row: [min(math.exp(x), 2.0) for x in lr],
    "token_mis": lambda lr, row: [math.exp(x) if 0.5 <= math.exp(x) <= 2.0 else 0.0 for x in lr],
    "seq_tis": lambda lr, row: [min(math.exp(sum(row)), 2.0)] * len(lr),
    "seq_mis": lambda lr, row: [math.exp(sum(row)) if 0.5 <= math.exp(sum(row)) <= 2.0 else 0.0] * len(lr),
    "geo_rs": lambda lr, row: [float(0.999 <= math.exp(sum(row) / len(row)) <= 1.001)] * len(lr),
}


# each preset in TRL's vocabulary (vllm_importance_sampling_*) plus our geometric rejection
PRESET_FIELDS = {
    "none": dict(vllm_importance_sampling_correction=False),
    "token_tis": dict(vllm_importance_sampling_mode="token_truncate"),
    "token_mis": dict(vllm_importance_sampling_mode="token_mask"),
    "seq_tis": dict(vllm_importance_sampling_mode="sequence_truncate"),
    "seq_mis": dict(vllm_importance_sampling_mode="sequence_mask"),
    "geo_rs": dict(vllm_importance_sampling_correction=False, rollout_geometric_rejection=True),
}


@pytest.mark.parametrize("preset", sorted(PRESET_WEIGHTS))
def test_each_preset_scales_the_loss_as_defined(tokenizer, tmp_path, preset):
    trainer = _trainer(tokenizer, tmp_path, loss_type="dapo", entropy_coef=0.0, **PRESET_FIELDS[preset])
    torch.manual_seed(0)
    prompt = torch.randint(10, 500, (2, 5))
    completion = torch.randint(10, 500, (2, 4))
    ones = torch.ones_like
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt, completion], 1), torch.cat([ones(prompt), ones(completion)], 1), 4
        )
    log_r = torch.tensor([[1.0, 0.0, -0.2, 0.1], [0.0004, 0.0004, 0.0004, 0.0]])  # row 1: G ~ exp(0.0003)
    advantages = torch.tensor([1.0, -2.0])
    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": ones(prompt),
        "completion_ids": completion,
        "completion_mask": ones(completion),
        "advantages": advantages,
        "num_items_in_batch": torch.tensor(8.0),
        "sampling_per_token_logps": logps - log_r,
    }
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer sets at the start of an optimizer step
    loss = trainer._compute_loss(trainer.model, inputs).item()
    rows = log_r.tolist()
    weights = [PRESET_WEIGHTS[preset](row, row) for row in rows]
    # dapo on-policy: per-token loss -A * w, summed over the 8 loss tokens, normalised by 8 (one process, GA 1)
    expected = -sum(a * w for a, ws in zip(advantages.tolist(), weights) for w in ws) / 8.0
    assert loss == pytest.approx(expected, rel=1e-4, abs=1e-5), (preset, weights)
    assert torch.equal(inputs["advantages"], advantages)  # the batch TRL reuses is untouched


def test_every_step_logs_where_its_time_went(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path)
    trainer.train()
    for phase in ("weight_push", "generation", "tool_calls", "rewards", "loss_forward_backward", "optimizer"):
        values = logged(trainer, f"timing/{phase}")
        assert len(values) == 2 and all(v >= 0 for v in values), (phase, values)
    assert all(v > 0 for v in logged(trainer, "timing/generation") + logged(trainer, "timing/optimizer"))
    assert logged(trainer, "timing/old_logprobs") == []  # strictly on-policy: that pass never runs
    off_policy = _trainer(tokenizer, tmp_path, num_iterations=2)
    off_policy.train()
    assert len(logged(off_policy, "timing/old_logprobs")) == 1  # one generation feeds both iterations
