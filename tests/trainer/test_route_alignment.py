"""``RolloutRouteReplay.aligned``: the engine's routes placed on TRL's padded batch, or a loud error."""

from types import SimpleNamespace

import pytest
import torch

from trl_gptoss.rollout.routes import MISSING, RouteShape
from trl_gptoss.trainer.loss_pass import LocalCollectives
from trl_gptoss.trainer.replay import RolloutRouteReplay

SHAPE = RouteShape(layers=2, top_k=2, num_experts=4)
PAD = 0


def _rollout(prompt, completion, routed=True):
    positions = len(prompt) + len(completion)
    routes = torch.arange(positions * 4, dtype=torch.int16).reshape(positions, 2, 2) % 4 if routed else None
    return SimpleNamespace(prompt_ids=prompt, completion_ids=completion, routes=routes, route_notes=[])


def _padded(rollouts, prompt_len, completion_len):
    rows = []
    for r in rollouts:
        left = [PAD] * (prompt_len - len(r.prompt_ids))
        right = [PAD] * (completion_len - len(r.completion_ids))
        rows.append(left + r.prompt_ids + r.completion_ids + right)
    return torch.tensor(rows)


def test_routes_land_on_their_tokens_and_padding_has_none():
    rollouts = [_rollout([5, 6, 7], [8, 9]), _rollout([5], [8, 9, 10, 11]), _rollout([4, 4], [3], routed=False)]
    replay = RolloutRouteReplay(SHAPE)
    metrics = replay.keep(rollouts, LocalCollectives(None))
    assert metrics == {"rollout/routes_missing_fraction": pytest.approx(2 / 10)}  # the unrouted one: 2 of 2
    input_ids = _padded(rollouts, prompt_len=4, completion_len=6)  # TRL's pad_to_multiple_of can widen both
    aligned = replay.aligned(input_ids, completion_length=6)
    assert aligned.shape == (3, 10, 2, 2) and aligned.dtype == torch.int16
    assert torch.equal(aligned[0, 1:6], rollouts[0].routes) and (aligned[0, [0, 6, 7, 8, 9]] == MISSING).all()
    assert torch.equal(aligned[1, 3:8], rollouts[1].routes) and (aligned[1, :3] == MISSING).all()
    assert (aligned[2] == MISSING).all()
    output = {"prompt_ids": input_ids[:, :4], "completion_ids": input_ids[:, 4:]}
    assert torch.equal(replay.take(output), aligned)


def test_a_batch_that_is_not_the_rollouts_is_refused():
    rollouts = [_rollout([5, 6, 7], [8, 9]), _rollout([5], [8, 9, 10, 11])]
    replay = RolloutRouteReplay(SHAPE)
    replay.keep(rollouts, LocalCollectives(None))
    input_ids = _padded(rollouts, prompt_len=3, completion_len=4)
    shifted = input_ids.clone()
    shifted[0] = torch.roll(shifted[0], 1)  # one row padded differently
    with pytest.raises(RuntimeError, match="row 0: the batch's token ids .* misaligned"):
        replay.aligned(shifted, completion_length=4)
    with pytest.raises(RuntimeError, match="does not fit|misaligned"):
        replay.aligned(input_ids[:, 1:], completion_length=4)  # a prompt cut short
    with pytest.raises(RuntimeError, match="holds routes for 2 rollouts, the batch has 1"):
        replay.aligned(input_ids[:1], completion_length=4)
    with pytest.raises(RuntimeError, match="holds routes for None"):
        RolloutRouteReplay(SHAPE).aligned(input_ids, completion_length=4)


def test_a_batch_mostly_without_routes_fails_the_step_above_the_threshold():
    """A replay whose routes are missing for most positions is the trainer's own routing in disguise: above
    ``routes_missing_max_fraction`` the step fails, naming the fraction, the field and the engine's reasons."""
    unrouted = SimpleNamespace(prompt_ids=[4, 4, 4], completion_ids=[3, 3], routes=None, route_notes=["turn 1: x"])
    rollouts = [_rollout([5, 6, 7], [8, 9]), unrouted]  # 4 of the 8 positions that count have no route
    assert RolloutRouteReplay(SHAPE, max_missing=0.5).keep(rollouts, LocalCollectives(None)) == {
        "rollout/routes_missing_fraction": 0.5
    }
    with pytest.raises(RuntimeError, match=r"50\.0% of this batch's positions .* routes_missing_max_fraction=0.4"):
        RolloutRouteReplay(SHAPE, max_missing=0.4).keep(rollouts, LocalCollectives(None))
    with pytest.raises(RuntimeError, match=r"turn 1: x"):
        RolloutRouteReplay(SHAPE, max_missing=0.0).keep(rollouts, LocalCollectives(None))


def test_the_threshold_is_a_fraction(tmp_path):
    from tests.trainer.helpers import grpo_args

    assert grpo_args(tmp_path).routes_missing_max_fraction == 0.5
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="routes_missing_max_fraction"):
            grpo_args(tmp_path, routes_missing_max_fraction=bad)
