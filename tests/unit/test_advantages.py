"""Advantage estimators checked against numbers worked out by hand (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from agentgrad.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageOutput,
    AdvantageParams,
    gae,
    grpo,
    masked_whiten,
    reinforce_pp,
    rloo,
    turn_index,
    turn_returns,
    zero_signal_groups,
)
from agentgrad.registry import UnknownNameError

P = AdvantageParams()
DR = AdvantageParams(norm_by_std=False)


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def outcome_batch(scores, lengths, width):
    """One single-turn row per score: prompt token at 0, `length` policy tokens, outcome on the last one."""
    B = len(scores)
    mask = torch.zeros(B, width)
    rewards = torch.zeros(B, width)
    for b, (s, n) in enumerate(zip(scores, lengths)):
        mask[b, 1:1 + n] = 1
        rewards[b, n] = s
    return rewards, mask


# ---- turns --------------------------------------------------------------------------------------------------


def test_turn_index_splits_on_observation_tokens():
    mask = t([[0, 1, 1, 0, 0, 1, 0, 1],
              [1, 1, 1, 1, 0, 0, 0, 0],
              [0, 0, 0, 0, 0, 0, 0, 0]])
    assert turn_index(mask).tolist() == [[-1, 0, 0, -1, -1, 1, -1, 2],
                                         [0, 0, 0, 0, -1, -1, -1, -1],
                                         [-1] * 8]


def test_turn_returns_discount_per_turn_not_per_token():
    # prompt | turn 0 (3 tokens, process 0.2) | obs | turn 1 (2 tokens, process -0.1) | obs | turn 2 (outcome 1.0)
    mask = t([[0, 1, 1, 1, 0, 1, 1, 0, 1, 0]])
    rew = t([[0, 0, 0, 0.2, 0, 0, -0.1, 0, 1.0, 0]])
    returns, scores = turn_returns(rew, mask, gamma=0.5)
    # G_2 = 1.0
    # G_1 = -0.1 + 0.5 * 1.0 = 0.4
    # G_0 = 0.2 + 0.5 * 0.4 = 0.4      (3 tokens in turn 0 but one discount step: per turn, not per token)
    expected = [[0, 0.4, 0.4, 0.4, 0, 0.4, 0.4, 0, 1.0, 0]]
    torch.testing.assert_close(returns, t(expected))
    torch.testing.assert_close(scores, t([0.4]))


def test_turn_returns_gamma_one_outcome_only_is_outcome_everywhere():
    mask = t([[0, 1, 0, 1, 1]])
    rew = t([[0, 0, 0, 0, 0.7]])
    returns, scores = turn_returns(rew, mask, gamma=1.0)
    torch.testing.assert_close(returns, t([[0, 0.7, 0, 0.7, 0.7]]))
    torch.testing.assert_close(scores, t([0.7]))


# ---- grpo ---------------------------------------------------------------------------------------------------


def test_grpo_single_group_unbiased_std():
    rew, mask = outcome_batch([1.0, 0.0, 0.0, 1.0], lengths=[2, 3, 1, 2], width=5)
    out = grpo(rew, mask, torch.zeros(4, dtype=torch.long), None, P)
    # mean = 0.5; deviations +-0.5; unbiased var = 4 * 0.25 / (4 - 1) = 1/3; std = 0.577350
    # A = +-0.5 / (0.577350 + 1e-6) = +-0.866024
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = t([[0, a, a, 0, 0],
                  [0, -a, -a, -a, 0],
                  [0, -a, 0, 0, 0],
                  [0, a, a, 0, 0]])
    torch.testing.assert_close(out.advantages, expected)
    # returns are the per-token outcome
    torch.testing.assert_close(out.returns, t([[0, 1, 1, 0, 0], [0] * 5, [0] * 5, [0, 1, 1, 0, 0]]))


def test_dr_grpo_no_std_scaling():
    rew, mask = outcome_batch([1.0, 0.0, 0.0, 1.0], lengths=[1, 1, 1, 1], width=2)
    out = grpo(rew, mask, torch.zeros(4, dtype=torch.long), None, DR)
    # mean = 0.5 -> A = r - 0.5
    torch.testing.assert_close(out.advantages, t([[0, 0.5], [0, -0.5], [0, -0.5], [0, 0.5]]))


def test_grpo_two_groups_are_independent():
    rew, mask = outcome_batch([1.0, 3.0, 10.0, 20.0], lengths=[1, 1, 1, 1], width=2)
    out = grpo(rew, mask, torch.tensor([0, 0, 1, 1]), None, DR)
    # group 0: mean 2 -> -1, +1; group 1: mean 15 -> -5, +5
    torch.testing.assert_close(out.advantages[:, 1], t([-1, 1, -5, 5]))


def test_grpo_masked_row_excluded_from_stats_and_zero():
    rew, mask = outcome_batch([1.0, 0.0, 5.0], lengths=[1, 1, 1], width=2)
    mask[2] = 0  # masked sample: keeps its (bogus) reward, but its loss_mask is all zero
    out = grpo(rew, mask, torch.zeros(3, dtype=torch.long), None, P)
    # stats over rows 0, 1 only: mean 0.5, unbiased std = sqrt(2 * 0.25 / 1) = 0.707107
    # A = +-0.5 / 0.707107 = +-0.707106
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(out.advantages, t([[0, a], [0, -a], [0, 0]]))
    torch.testing.assert_close(out.returns[2], t([0, 0]))


def test_grpo_and_rloo_groups_of_one_get_zero():
    rew, mask = outcome_batch([1.0, 1.0, 0.0], lengths=[1, 1, 1], width=2)
    mask[2] = 0  # group 1 has one valid row (row 1) and one masked row (row 2)
    gi = torch.tensor([0, 1, 1])
    for est in (grpo, rloo):
        out = est(rew, mask, gi, None, P)
        torch.testing.assert_close(out.advantages, torch.zeros(3, 2))


def test_grpo_zero_signal_group_gives_zero_and_is_detected():
    rew, mask = outcome_batch([1.0, 1.0, 1.0, 0.0, 1.0], lengths=[1, 1, 1, 1, 1], width=2)
    gi = torch.tensor([0, 0, 1, 1, 2])
    out = grpo(rew, mask, gi, None, P)
    # group 0: all 1.0 -> (1 - 1) / (0 + eps) = 0; group 2 has one row -> 0
    # group 1: mean .5, std sqrt(.5) -> +-0.707106
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(out.advantages[:, 1], t([0, 0, a, -a, 0]))
    valid = mask.sum(1) > 0
    _, scores = turn_returns(rew, mask, 1.0)
    assert zero_signal_groups(scores, gi, valid).tolist() == [True, False, True]


@pytest.mark.parametrize("value", [0.7, 0.1, 0.9, 2.2])
def test_zero_signal_group_is_exactly_zero_despite_float32_rounding(value):
    # in float32, sum(7 * [0.7]) / 7 != 0.7; dividing the ~1e-7 residue by (0 + eps) used to give ~0.06
    rew, mask = outcome_batch([value] * 7 + [0.0, 1.0], lengths=[1] * 9, width=2)
    gi = torch.tensor([0] * 7 + [1, 1])
    for name in ("grpo", "rloo"):
        adv = ADVANTAGE_ESTIMATORS.get(name)(rew, mask, gi, None, P).advantages
        assert (adv[:7] == 0).all(), name
        assert (adv[7:, 1] != 0).all(), name


def test_zero_signal_multi_turn_group_is_zero_on_later_turns_too():
    # both rows: turn 0 earns process 0.2, turn 1 the outcome 1.0 -> equal scores 1.2
    # without the zero-signal rule, turn 1 would get (1.0 - 1.2) / (0 + eps) = -200000
    mask = t([[1, 0, 1], [1, 0, 1]])
    rew = t([[0.2, 0, 1.0], [0.2, 0, 1.0]])
    for name in ("grpo", "rloo"):
        adv = ADVANTAGE_ESTIMATORS.get(name)(rew, mask, torch.tensor([0, 0]), None, P).advantages
        assert (adv == 0).all(), name


def test_zero_signal_groups_ignores_invalid_rows_and_counts_absent_groups():
    scores = t([1.0, 1.0, 0.0, 2.0, 3.0])
    gi = torch.tensor([0, 0, 0, 1, 1])
    valid = torch.tensor([True, True, False, True, True])
    # group 0: valid scores {1, 1} (the 0.0 is invalid) -> zero-signal; group 1: {2, 3} -> signal
    # group 2 never occurs -> zero-signal
    assert zero_signal_groups(scores, gi, valid, num_groups=3).tolist() == [True, False, True]
    # with a tolerance, 2 vs 3 counts as equal
    assert zero_signal_groups(scores, gi, valid, atol=1.5).tolist() == [True, True]


def test_dr_grpo_multi_turn_advantage_uses_turn_return_minus_episode_baseline():
    # row 0: turn 0 (process 0.2) | obs | turn 1 (outcome 1.0); row 1: one turn, outcome 0.0
    mask = t([[1, 1, 0, 1, 1],
              [1, 1, 1, 0, 0]])
    rew = t([[0, 0.2, 0, 0, 1.0],
             [0, 0, 0.0, 0, 0]])
    params = AdvantageParams(gamma=0.5, norm_by_std=False)
    out = grpo(rew, mask, torch.zeros(2, dtype=torch.long), None, params)
    # row 0: G_1 = 1.0, G_0 = 0.2 + 0.5 * 1.0 = 0.7; row 1: G_0 = 0
    # baseline = mean(0.7, 0) = 0.35
    # row 0: turn 0 -> 0.7 - 0.35 = 0.35; turn 1 -> 1.0 - 0.35 = 0.65; row 1: -0.35
    torch.testing.assert_close(out.advantages, t([[0.35, 0.35, 0, 0.65, 0.65],
                                                  [-0.35, -0.35, -0.35, 0, 0]]))
    torch.testing.assert_close(out.returns, t([[0.7, 0.7, 0, 1.0, 1.0], [0, 0, 0, 0, 0]]))
    # normalised: unbiased std of (0.7, 0) = sqrt(2 * 0.35^2 / 1) = 0.494975
    std = 0.35 * math.sqrt(2) + 1e-6
    out = grpo(rew, mask, torch.zeros(2, dtype=torch.long), None, AdvantageParams(gamma=0.5))
    torch.testing.assert_close(out.advantages[0, 3], torch.tensor(0.65 / std))  # 1.313198
    torch.testing.assert_close(out.advantages[1, 0], torch.tensor(-0.35 / std))  # -0.707106


# ---- rloo ---------------------------------------------------------------------------------------------------


def test_rloo_leave_one_out_baseline():
    rew, mask = outcome_batch([1.0, 0.0, 0.0, 1.0, 9.0], lengths=[1, 2, 1, 1, 1], width=3)
    mask[4] = 0  # masked: not part of anyone's baseline
    out = rloo(rew, mask, torch.zeros(5, dtype=torch.long), None, P)
    # row 0: baseline (0 + 0 + 1) / 3 = 1/3 -> 1 - 1/3 = 2/3
    # row 1: baseline (1 + 0 + 1) / 3 = 2/3 -> 0 - 2/3 = -2/3 (both of its tokens)
    # row 2: same as row 1; row 3: same as row 0; row 4: masked -> 0
    a = 2 / 3
    torch.testing.assert_close(out.advantages, t([[0, a, 0], [0, -a, -a], [0, -a, 0], [0, a, 0], [0, 0, 0]]))


def test_rloo_multi_turn():
    # row 0: turn 0 (process 0.5) | obs | turn 1 (outcome 1.0); rows 1, 2: one turn with outcome 0.5 / 0.0
    mask = t([[1, 0, 1], [1, 0, 0], [1, 0, 0]])
    rew = t([[0.5, 0, 1.0], [0.5, 0, 0], [0.0, 0, 0]])
    out = rloo(rew, mask, torch.zeros(3, dtype=torch.long), None, AdvantageParams(gamma=1.0))
    # scores: row 0 = 0.5 + 1.0 = 1.5, row 1 = 0.5, row 2 = 0
    # row 0: baseline (0.5 + 0) / 2 = 0.25 -> turn 0: 1.5 - 0.25 = 1.25, turn 1: G_1 = 1.0 -> 0.75
    # row 1: baseline (1.5 + 0) / 2 = 0.75 -> -0.25; row 2: baseline (1.5 + 0.5) / 2 = 1.0 -> -1.0
    torch.testing.assert_close(out.advantages, t([[1.25, 0, 0.75], [-0.25, 0, 0], [-1.0, 0, 0]]))


# ---- reinforce++ --------------------------------------------------------------------------------------------


def test_reinforce_pp_batch_normalisation_over_tokens():
    rew, mask = outcome_batch([1.0, 0.0], lengths=[2, 3], width=5)
    gi = torch.tensor([0, 1])  # groups are ignored
    out = reinforce_pp(rew, mask, gi, None, P)
    # token returns: [1, 1] and [0, 0, 0]; mean = 2/5 = 0.4
    # population var = (2 * 0.6^2 + 3 * 0.4^2) / 5 = (0.72 + 0.48) / 5 = 0.24; std = 0.489898
    # row 0: 0.6 / 0.489898 = 1.224744; row 1: -0.4 / 0.489898 = -0.816496
    std = math.sqrt(0.24) + 1e-6
    a, b = 0.6 / std, -0.4 / std
    torch.testing.assert_close(out.advantages, t([[0, a, a, 0, 0], [0, b, b, b, 0]]))
    out = reinforce_pp(rew, mask, gi, None, DR)
    torch.testing.assert_close(out.advantages, t([[0, 0.6, 0.6, 0, 0], [0, -0.4, -0.4, -0.4, 0]]))


def test_masked_whiten_empty_mask_is_zero():
    assert masked_whiten(torch.ones(2, 3), torch.zeros(2, 3)).abs().sum() == 0
    assert masked_whiten(torch.ones(2, 3), t([[1, 0, 0], [0, 0, 0]]), unbiased=True).abs().sum() == 0


def test_masked_whiten_population_by_default_unbiased_as_verl():
    x = t([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    # masked entries 1, 2, 3, 4: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    # population var 5 / 4 = 1.25, std 1.118034; unbiased (verl) var 5 / 3 = 1.666667, std 1.290994
    pop, unb = math.sqrt(1.25) + 1e-6, math.sqrt(5 / 3) + 1e-6
    dev = t([[-1.5, -0.5, 0.5, 0.0], [1.5, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(masked_whiten(x, mask), dev / pop)
    torch.testing.assert_close(masked_whiten(x, mask, unbiased=True), dev / unb)
    # the ratio is sqrt((n - 1) / n) = sqrt(3 / 4) = 0.866025 on every entry
    ratio = masked_whiten(x, mask, unbiased=True)[mask > 0] / masked_whiten(x, mask)[mask > 0]
    torch.testing.assert_close(ratio, torch.full((4,), math.sqrt(0.75)), atol=1e-5, rtol=0)
    # scale=False only centres: 1 - 2.5 = -1.5, ...
    torch.testing.assert_close(masked_whiten(x, mask, scale=False), dev)


def test_reinforce_pp_equal_returns_give_exactly_zero():
    rew, mask = outcome_batch([0.7] * 7, lengths=[3] * 7, width=4)
    out = reinforce_pp(rew, mask, torch.zeros(7, dtype=torch.long), None, P)
    assert (out.advantages == 0).all() and out.advantages.dtype == torch.float32


# ---- gae ----------------------------------------------------------------------------------------------------


def test_gae_skips_observation_tokens_and_bootstraps_across_turns():
    # row 0: prompt | turn 0 (2 tokens, process 0.5 on the 2nd) | obs obs | turn 1 (1 token, outcome 1.0) | pad
    # row 1: prompt | 1 token with outcome -1.0 | pad ...
    mask = t([[0, 1, 1, 0, 0, 1, 0],
              [0, 1, 0, 0, 0, 0, 0]])
    rew = t([[0, 0, 0.5, 0, 0, 1.0, 0],
             [0, -1.0, 0, 0, 0, 0, 0]])
    # values off the policy tokens are garbage (9.0) and must not matter
    values = t([[9, 0.2, 0.4, 9, 9, 0.6, 9],
                [9, 0.3, 9, 9, 9, 9, 9]])
    out = gae(rew, mask, torch.tensor([0, 0]), values, AdvantageParams(gamma=0.9, lam=0.8))
    # row 0, policy steps t1 (r 0, V .2), t2 (r .5, V .4), t5 (r 1, V .6); gamma * lam = 0.72
    # t5: delta = 1 + 0.9 * 0 - 0.6 = 0.4                     A = 0.4
    # t2: delta = 0.5 + 0.9 * 0.6 - 0.4 = 0.64                A = 0.64 + 0.72 * 0.4 = 0.928
    # t1: delta = 0 + 0.9 * 0.4 - 0.2 = 0.16                  A = 0.16 + 0.72 * 0.928 = 0.82816
    # row 1: t1: delta = -1 + 0 - 0.3 = -1.3                   A = -1.3
    torch.testing.assert_close(out.advantages, t([[0, 0.82816, 0.928, 0, 0, 0.4, 0],
                                                  [0, -1.3, 0, 0, 0, 0, 0]]))
    # returns = A + V: 1.02816, 1.328, 1.0; -1.0
    torch.testing.assert_close(out.returns, t([[0, 1.02816, 1.328, 0, 0, 1.0, 0],
                                               [0, -1.0, 0, 0, 0, 0, 0]]))


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    mask = t([[1, 1, 1]])
    rew = t([[0.1, 0.2, 0.3]])
    values = t([[0.5, 0.5, 0.5]])
    out = gae(rew, mask, torch.tensor([0]), values, AdvantageParams(gamma=1.0, lam=1.0))
    # Monte Carlo: returns 0.6, 0.5, 0.3; minus V = 0.1, 0.0, -0.2
    torch.testing.assert_close(out.advantages, t([[0.1, 0.0, -0.2]]))
    torch.testing.assert_close(out.returns, t([[0.6, 0.5, 0.3]]))


def test_gae_needs_values():
    with pytest.raises(ValueError, match="needs values"):
        gae(torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([0]), None, P)


def test_gae_masked_row_is_zero():
    out = gae(t([[1.0, 2.0]]), t([[0, 0]]), torch.tensor([0]), t([[3.0, 4.0]]), P)
    assert out.advantages.abs().sum() == 0 and out.returns.abs().sum() == 0


# ---- all estimators -----------------------------------------------------------------------------------------


def _multi_turn_batch():
    mask = t([[0, 1, 1, 0, 1, 0],
              [0, 1, 0, 1, 1, 1],
              [0, 1, 1, 1, 0, 0],
              [0, 1, 1, 0, 0, 0]])
    rew = t([[0, 0, 0.3, 0, 1.0, 0],
             [0, 0.1, 0, 0, 0, 0.0],
             [0, 0, 0, 0.5, 0, 0],
             [0, 0, 0.8, 0, 0, 0]])
    values = torch.linspace(-1, 1, 24).reshape(4, 6)
    gi = torch.tensor([0, 0, 1, 1])
    return rew, mask, gi, values


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "gae"])
def test_padding_does_not_change_results_and_outputs_zero_off_mask(name):
    est = ADVANTAGE_ESTIMATORS.get(name)
    rew, mask, gi, values = _multi_turn_batch()
    params = AdvantageParams(gamma=0.9, lam=0.9)
    base = est(rew, mask, gi, values, params)
    assert isinstance(base, AdvantageOutput)
    assert ((base.advantages != 0) & (mask == 0)).sum() == 0
    assert ((base.returns != 0) & (mask == 0)).sum() == 0
    # three more padding columns with garbage rewards and values
    pad = 3
    rew_p = torch.cat([rew, torch.full((4, pad), 7.0)], dim=1)
    mask_p = torch.cat([mask, torch.zeros(4, pad)], dim=1)
    values_p = torch.cat([values, torch.full((4, pad), -5.0)], dim=1)
    padded = est(rew_p, mask_p, gi, values_p, params)
    torch.testing.assert_close(padded.advantages[:, :6], base.advantages)
    torch.testing.assert_close(padded.returns[:, :6], base.returns)
    assert padded.advantages[:, 6:].abs().sum() == 0


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "gae"])
def test_advantages_carry_no_gradient(name):
    rew, mask, gi, values = _multi_turn_batch()
    values = values.clone().requires_grad_(True)
    out = ADVANTAGE_ESTIMATORS.get(name)(rew, mask, gi, values, P)
    assert not out.advantages.requires_grad


def test_registry_names_and_unknown_name_lists_valid():
    assert ADVANTAGE_ESTIMATORS.names() == ["gae", "grpo", "reinforce_pp", "rloo"]
    with pytest.raises(UnknownNameError, match="gae, grpo, reinforce_pp, rloo"):
        ADVANTAGE_ESTIMATORS.get("ppo")


def test_shape_mismatch_and_bad_params_raise():
    with pytest.raises(ValueError, match="group_index"):
        grpo(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3, dtype=torch.long), None, P)
    with pytest.raises(ValueError, match="gamma"):
        AdvantageParams(gamma=1.5)
