"""The mismatch monitor on a real rollout of the tiny model: the HF engine's sampled logprobs against the torch
learner's recomputation (same weights: they agree to float rounding), then with the sampler's logprobs shifted by
a known amount, which the monitor must report and the correction must bound."""

from __future__ import annotations

import math

import pytest
import torch
from test_train_tiny import FAST

from agentgrad.config import build_config
from agentgrad.pipelines import rl
from agentgrad.pipelines.components import build_components


@pytest.fixture(scope="module")
def rollout_batch(tmp_path_factory):
    config = build_config(overrides=[*FAST, "algo.tasks_per_step=2", "algo.group_size=2", "mismatch.monitor=true",
                                     "mismatch.correction=auto", "mismatch.auto_threshold=0.05",
                                     "mismatch.is_bound=1.2"])
    c = build_components(config, tmp_path_factory.mktemp("mismatch"))
    state = rl.start_rl(c)
    batch = rl.make_batch(c, rl.rollout_groups(c, rl.rl_tasks(c, 0), 0))
    return c, state, batch


def test_same_weights_agree_to_rounding_and_stay_uncorrected(rollout_batch):
    c, state, batch = rollout_batch
    out, m = rl.correct_off_policy(c, state, batch, num_fresh=batch.num_sequences)
    assert m["mismatch/tokens"] == batch.num_policy_tokens > 0
    # float32 sampling (KV-cached decode) vs a full-sequence forward: rounding only
    assert m["mismatch/max_abs_logprob_diff"] < 1e-4, m
    assert m["mismatch/corrected"] == 0.0 and out is batch


@pytest.mark.parametrize("shift", [0.3, -0.3])
def test_a_known_shift_is_reported_and_the_correction_bounds_the_weights(rollout_batch, shift):
    c, state, batch = rollout_batch
    mask = batch.loss_mask
    shifted = batch.replace(old_logprobs=batch.old_logprobs + shift * mask)  # the sampler off by `shift` nat
    out, m = rl.correct_off_policy(c, state, shifted, num_fresh=batch.num_sequences)
    # learner - sampler = (rounding) - shift on every policy token
    assert m["mismatch/mean_abs_logprob_diff"] == pytest.approx(abs(shift), abs=1e-4)
    assert m["mismatch/mean_logprob_diff"] == pytest.approx(-shift, abs=1e-4)
    assert m["mismatch/max_abs_logprob_diff"] == pytest.approx(abs(shift), abs=1e-4)
    assert m["mismatch/ratio_p50"] == pytest.approx(math.exp(-shift), abs=1e-4)
    assert m["mismatch/abs_diff_1e-1_1e0"] == 1.0
    assert m["mismatch/corrected"] == 1.0  # 0.3 > auto_threshold 0.05
    on = mask > 0
    # token ratio exp(-0.3) = 0.7408 stays under the bound 1.2; exp(0.3) = 1.3499 is truncated to 1.2
    expected = min(math.exp(-shift), 1.2)
    assert out.is_weights[on].min().item() == pytest.approx(expected, abs=1e-4)
    assert out.is_weights[on].max().item() == pytest.approx(expected, abs=1e-4)
    assert float(out.is_weights[~on].abs().max()) == 0.0
    assert m["mismatch/frac_truncated"] == (1.0 if shift < 0 else 0.0)
    # the clip is taken around the learner's logprobs, which are the unshifted ones up to rounding
    torch.testing.assert_close(out.old_logprobs[on], batch.old_logprobs[on], atol=1e-4, rtol=0)
