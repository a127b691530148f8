"""The train/inference mismatch monitor and its correction, on hand-built logprobs. Expected numbers worked out
in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from agentgrad.algos.mismatch import correct_mismatch, mismatch_metrics, mismatch_stats
from agentgrad.batch import TokenBatch
from agentgrad.config import MismatchConfig, build_config
from agentgrad.pipelines.mismatch import monitor_mismatch

# One row: 4 policy tokens with learner - sampler = +1.0, -0.5, 0.0, +0.002, then a padding token with garbage.
LEARNER = torch.tensor([[-1.0, -2.0, -0.5, -3.0, 7.0]])
SHIFT = torch.tensor([[1.0, -0.5, 0.0, 0.002, 0.0]])
SAMPLER = LEARNER - SHIFT
SAMPLER[0, 4] = -50.0
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])


def test_a_constant_shift_is_reported_exactly():
    learner = torch.tensor([[0.0, -1.0, -2.0, -0.25], [0.0, -0.5, -4.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    sampler = learner + 0.25 * mask  # the sampler 0.25 nat more confident on every policy token
    s = mismatch_stats(learner, sampler, mask)
    assert s.num_tokens == 5
    assert s.mean_diff.item() == pytest.approx(-0.25, abs=1e-7)
    assert s.mean_abs_diff.item() == pytest.approx(0.25, abs=1e-7)
    assert s.max_abs_diff.item() == pytest.approx(0.25, abs=1e-7)
    # every ratio is exp(-0.25) = 0.7788008
    assert s.ratio_quantiles.tolist() == pytest.approx([0.7788008] * 5, abs=1e-6)
    # |diff| = 0.25 lies in [0.1, 1): bucket 4 of 6
    assert s.abs_diff_histogram.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_mixed_shifts_statistics_and_metric_keys():
    s = mismatch_stats(LEARNER, SAMPLER, MASK)
    # mean (1 - 0.5 + 0 + 0.002) / 4 = 0.1255; mean |.| 1.502 / 4 = 0.3755; max 1.0; padding ignored
    assert s.mean_diff.item() == pytest.approx(0.1255, abs=1e-6)
    assert s.mean_abs_diff.item() == pytest.approx(0.3755, abs=1e-6)
    assert s.max_abs_diff.item() == pytest.approx(1.0, abs=1e-6)
    # ratios sorted: exp(-0.5) = 0.606531, 1, exp(0.002) = 1.002002, e = 2.718282; linear quantiles at
    # q (n - 1): p50 at 1.5 -> (1 + 1.002002) / 2 = 1.001001; p01 at 0.03 -> 0.606531 + 0.03 * 0.393469 = 0.618335
    q = s.ratio_quantiles.tolist()
    assert q[2] == pytest.approx(1.001001, abs=1e-6)
    assert q[0] == pytest.approx(0.618335, abs=1e-6)
    # buckets: 0 -> [0, 1e-4); 0.002 -> [1e-3, 1e-2); 0.5 -> [0.1, 1); 1.0 -> [1, inf)
    assert s.abs_diff_histogram.tolist() == [0.25, 0.0, 0.25, 0.0, 0.25, 0.25]
    m = mismatch_metrics(s)
    assert m["mismatch/mean_abs_logprob_diff"] == pytest.approx(0.3755, abs=1e-6)
    assert m["mismatch/max_abs_logprob_diff"] == pytest.approx(1.0, abs=1e-6)
    assert m["mismatch/ratio_p50"] == pytest.approx(1.001001, abs=1e-6)
    assert m["mismatch/abs_diff_lt_1e-4"] == 0.25 and m["mismatch/abs_diff_1e-3_1e-2"] == 0.25
    assert m["mismatch/abs_diff_ge_1e0"] == 0.25 and m["mismatch/tokens"] == 4.0


def test_no_policy_tokens_gives_on_policy_values():
    s = mismatch_stats(LEARNER, SAMPLER, torch.zeros_like(MASK))
    assert s.num_tokens == 0 and s.max_abs_diff.item() == 0.0
    assert s.abs_diff_histogram.tolist()[0] == 1.0


@pytest.mark.parametrize("level,mode,bound,expected", [
    # token ratios e, exp(-0.5), 1, exp(0.002): truncate at 2 -> 2, 0.606531, 1, 1.002002
    ("token", "truncate", 2.0, [2.0, 0.606531, 1.0, 1.002002, 0.0]),
    # mask: the token over the bound drops out of the loss
    ("token", "mask", 2.0, [0.0, 0.606531, 1.0, 1.002002, 0.0]),
    # one sequence weight exp(1 - 0.5 + 0 + 0.002) = exp(0.502) = 1.652022: under 2 it stays, on every token
    ("sequence", "truncate", 2.0, [1.652022] * 4 + [0.0]),
    # over a bound of 1.5 it is truncated to 1.5, or the whole sequence masked
    ("sequence", "truncate", 1.5, [1.5] * 4 + [0.0]),
    ("sequence", "mask", 1.5, [0.0] * 5),
])
def test_correction_bounds_the_weights(level, mode, bound, expected):
    old, weights, w = correct_mismatch(LEARNER, SAMPLER, MASK, torch.tensor([True]), level=level, mode=mode,
                                       bound=bound)
    assert weights[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert bool((weights <= bound).all())
    assert old.tolist() == LEARNER.tolist()  # the clip is now taken around the learner's distribution
    assert w.max.item() == pytest.approx(math.e if level == "token" else math.exp(0.502), rel=1e-6)


def _batch(num_rows: int = 2) -> TokenBatch:
    learner = LEARNER.repeat(num_rows, 1)
    return TokenBatch(input_ids=torch.zeros(num_rows, 5, dtype=torch.long),
                      attention_mask=torch.ones(num_rows, 5, dtype=torch.long), loss_mask=MASK.repeat(num_rows, 1),
                      old_logprobs=SAMPLER.repeat(num_rows, 1).clone(), token_rewards=torch.zeros(num_rows, 5),
                      group_index=torch.arange(num_rows)), learner


@pytest.mark.parametrize("correction,threshold,corrected", [
    ("off", 0.0, False), ("on", 100.0, True),
    ("auto", 0.37, True),   # mean |diff| 0.3755 > 0.37
    ("auto", 0.38, False),  # 0.3755 <= 0.38
])
def test_monitor_switches_the_correction_on_fresh_rows_only(correction, threshold, corrected):
    batch, learner = _batch()
    # row 1 was replayed (already weighted 0.5 by the replay correction); row 0 is fresh
    batch = batch.replace(is_weights=torch.full((2, 5), 0.5))
    learner[1] += 9.0  # a replayed row's gap must not enter the fresh rows' statistics
    config = MismatchConfig(monitor=True, correction=correction, auto_threshold=threshold)
    out, metrics = monitor_mismatch(config, batch, learner, num_fresh=1)
    assert metrics["mismatch/mean_abs_logprob_diff"] == pytest.approx(0.3755, abs=1e-6)
    assert metrics["mismatch/corrected"] == float(corrected)
    if corrected:
        assert out.is_weights[0].tolist() == pytest.approx([2.0, 0.606531, 1.0, 1.002002, 0.0], abs=1e-6)
        assert out.old_logprobs[0].tolist() == LEARNER[0].tolist()
        assert metrics["mismatch/frac_truncated"] == pytest.approx(0.25)
    else:
        assert out is batch
    assert out.is_weights[1].tolist() == [0.5] * 5 and out.old_logprobs[1].tolist() == SAMPLER[0].tolist()


def test_config_section_defaults_off_and_validates():
    config = build_config()
    assert not config.mismatch.scores
    assert build_config(overrides=["mismatch.correction=auto"]).mismatch.scores
    with pytest.raises(Exception, match="is_mode"):
        build_config(overrides=["mismatch.is_mode=clip"])
