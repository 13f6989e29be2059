"""Rollout-correction presets and mismatch metrics against their definitions, on hand-made inputs."""

import math

import pytest
import torch

from trl_gptoss.trainer.correction import (
    PRESETS,
    CorrectionThresholds,
    finalize_metrics,
    masked_log_ratio,
    mismatch_stats,
    rollout_correction,
)

LN2 = math.log(2.0)
# Row 0: per-token log r = [ln 3, 0, -ln 4] (3 loss tokens); row 1: [0.0005, 0.0005, pad] (2 loss tokens).
TRAIN = torch.tensor([[math.log(0.6), -1.0, math.log(0.1)], [-0.5 + 0.0005, -0.2 + 0.0005, 0.0]])
ROLLOUT = torch.tensor([[math.log(0.2), -1.0, math.log(0.4)], [-0.5, -0.2, -7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _weights(preset, **thresholds):
    lr = masked_log_ratio(TRAIN, ROLLOUT, MASK)
    return rollout_correction(lr, MASK, preset, CorrectionThresholds(**thresholds)), lr


def test_log_ratio_is_masked_and_nan_safe():
    rollout = ROLLOUT.clone()
    rollout[0, 1] = float("nan")
    lr = masked_log_ratio(TRAIN, rollout, MASK)
    assert lr[0, 1] == 0.0 and lr[1, 2] == 0.0
    torch.testing.assert_close(lr[0, 0], torch.tensor(math.log(3.0)))
    big = masked_log_ratio(torch.tensor([[0.0]]), torch.tensor([[-100.0]]), torch.ones(1, 1))
    assert big.item() == 20.0  # clamped like verl


def test_none_keeps_unit_weights_on_loss_tokens():
    corr, _ = _weights("none")
    torch.testing.assert_close(corr.weights, MASK.float())


def test_token_tis_truncates_each_token_at_upper():
    corr, _ = _weights("token_tis", is_upper=2.0)
    expected = torch.tensor([[2.0, 1.0, 0.25], [math.exp(0.0005)] * 2 + [0.0]])
    torch.testing.assert_close(corr.weights, expected)
    assert corr.clipped.tolist() == [[True, False, False], [False, False, False]]
    corr, _ = _weights("token_tis", is_upper=2.0, is_lower=0.5)
    assert corr.weights[0, 2].item() == pytest.approx(0.5)


def test_token_mis_zeroes_tokens_outside_bounds():
    corr, _ = _weights("token_mis", is_upper=2.0)  # lower defaults to 1/upper = 0.5
    expected = torch.tensor([[0.0, 1.0, 0.0], [math.exp(0.0005)] * 2 + [0.0]])
    torch.testing.assert_close(corr.weights, expected)
    assert corr.masked.tolist() == [[True, False, True], [False, False, False]]


def test_sequence_presets_use_the_product_of_token_ratios():
    # row 0: R = 3 * 1 * 0.25 = 0.75; row 1: R = exp(0.001)
    corr, _ = _weights("seq_tis", is_upper=2.0)
    torch.testing.assert_close(corr.weights[0], torch.full((3,), 0.75))
    torch.testing.assert_close(corr.weights[1], torch.tensor([math.exp(0.001)] * 2 + [0.0]))
    corr, _ = _weights("seq_tis", is_upper=0.5)
    torch.testing.assert_close(corr.weights[0], torch.full((3,), 0.5))
    corr, _ = _weights("seq_mis", is_upper=1.2, is_lower=0.8)  # 0.75 < 0.8: row 0 dropped
    assert corr.weights[0].tolist() == [0.0, 0.0, 0.0]
    assert corr.masked[0].tolist() == [True, True, True] and corr.masked[1].tolist() == [False, False, False]


def test_geometric_rejection_drops_whole_sequences():
    # row 0: G = 0.75 ** (1/3) ~ 0.909 -> rejected by [0.999, 1.001]; row 1: G = exp(0.0005) kept
    corr, _ = _weights("geo_rs")
    assert corr.rejected_seqs.tolist() == [True, False]
    torch.testing.assert_close(corr.weights, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    corr, _ = _weights("geo_rs", rs_lower=0.9, rs_upper=1.1)
    assert corr.rejected_seqs.tolist() == [False, False]
    corr, _ = _weights("geo_rs_token_tis", rs_lower=0.9, rs_upper=1.1, is_upper=2.0)
    torch.testing.assert_close(corr.weights[0], torch.tensor([2.0, 1.0, 0.25]))


def test_every_preset_is_covered():
    assert set(PRESETS) == {"none", "token_tis", "token_mis", "seq_tis", "seq_mis", "geo_rs", "geo_rs_token_tis"}


def test_metrics_match_their_definitions():
    corr, lr = _weights("token_tis", is_upper=2.0)
    sums, maxes = mismatch_stats(TRAIN, ROLLOUT, MASK, corr, lr)
    m = finalize_metrics(sums, maxes)
    tokens = [math.log(3.0), 0.0, -2 * LN2, 0.0005, 0.0005]
    n = len(tokens)
    assert m["kl_k1"] == pytest.approx(sum(-t for t in tokens) / n, rel=1e-5)
    assert m["kl_k3"] == pytest.approx(sum(math.exp(t) - 1 - t for t in tokens) / n, rel=1e-5)
    assert m["abs_logp_diff_max"] == pytest.approx(math.log(4.0), rel=1e-6)
    assert m["abs_logp_diff_mean"] == pytest.approx(sum(abs(t) for t in tokens) / n, rel=1e-5)
    assert m["log_ratio_min"] == pytest.approx(-math.log(4.0), rel=1e-6)
    assert m["is_clip_fraction"] == pytest.approx(1 / n)
    w = [2.0, 1.0, 0.25, math.exp(0.0005), math.exp(0.0005)]
    assert m["ess"] == pytest.approx((sum(w) / n) ** 2 / (sum(x * x for x in w) / n), rel=1e-6)
    train_nll = [-(math.log(0.6) - 1.0 + math.log(0.1)) / 3, -(-0.7 + 0.001) / 2]
    rollout_nll = [-(math.log(0.2) - 1.0 + math.log(0.4)) / 3, 0.7 / 2]
    assert m["training_ppl"] == pytest.approx(sum(math.exp(x) for x in train_nll) / 2, rel=1e-5)
    assert m["rollout_ppl"] == pytest.approx(sum(math.exp(x) for x in rollout_nll) / 2, rel=1e-5)
    assert m["log_ppl_diff"] == pytest.approx((sum(train_nll) - sum(rollout_nll)) / 2, rel=1e-5)


def test_stats_of_two_halves_add_up_to_the_whole():
    corr, lr = _weights("seq_mis", is_upper=1.2, is_lower=0.8)
    whole = finalize_metrics(*mismatch_stats(TRAIN, ROLLOUT, MASK, corr, lr))
    parts = [
        mismatch_stats(
            TRAIN[i : i + 1],
            ROLLOUT[i : i + 1],
            MASK[i : i + 1],
            rollout_correction(
                lr[i : i + 1], MASK[i : i + 1], "seq_mis", CorrectionThresholds(is_upper=1.2, is_lower=0.8)
            ),
            lr[i : i + 1],
        )
        for i in range(2)
    ]
    merged = finalize_metrics(parts[0][0] + parts[1][0], torch.maximum(parts[0][1], parts[1][1]))
    assert merged == pytest.approx(whole)
    assert whole["is_mask_fraction"] == pytest.approx(3 / 5) and whole["is_weight_mean"] == pytest.approx(
        2 * math.exp(0.001) / 5, rel=1e-6
    )


@pytest.mark.parametrize(
    "bad, key",
    [
        (dict(is_upper=0.0), "clip_max"),
        (dict(is_lower=3.0), "clip_min"),
        (dict(rs_lower=1.01), "rollout_rs_threshold_lower"),
        (dict(rs_upper=0.9), "rollout_rs_threshold"),
    ],
)
def test_bad_thresholds_are_refused_naming_the_config_key(bad, key):
    with pytest.raises(ValueError, match=key):
        CorrectionThresholds(**bad)
