"""KL estimators, penalty and controllers checked against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agentgrad.algos.kl import (
    K3_CAP,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    KL_UNITS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    kl_estimate,
    kl_loss,
    kl_reward_penalty,
    make_kl_controller,
    sequence_kl,
)
from agentgrad.registry import UnknownNameError

LN2 = math.log(2.0)


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(x, expected, **kw):
    torch.testing.assert_close(x, torch.as_tensor(expected, dtype=x.dtype), **kw)


# token 1: pi = 0.5, ref = 0.25 -> log r = ln(0.25 / 0.5) = -ln 2
# token 2: pi = 0.25, ref = 0.5 -> log r = +ln 2
LOGP = torch.log(t([[0.5, 0.25]]))
REF = torch.log(t([[0.25, 0.5]]))


def test_k1():
    # k1 = -log r = log pi - log ref: +ln 2 = 0.693147, -ln 2
    close(kl_estimate(LOGP, REF, "k1"), [[LN2, -LN2]])


def test_k2():
    # k2 = 0.5 (log r)^2 = 0.5 * 0.480453 = 0.240227 for both
    close(kl_estimate(LOGP, REF, "k2"), [[0.5 * LN2**2, 0.5 * LN2**2]])


def test_k3():
    # k3 = (r - 1) - log r
    # token 1: r = 0.5 -> -0.5 + 0.693147 = 0.193147
    # token 2: r = 2   ->  1.0 - 0.693147 = 0.306853
    close(kl_estimate(LOGP, REF, "k3"), [[0.193147, 0.306853]], atol=1e-6, rtol=0)
    assert (kl_estimate(LOGP, REF) == kl_estimate(LOGP, REF, "k3")).all()  # k3 is the default


def test_log_ratio_is_clamped_to_20_and_k3_capped_at_10():
    logp = t([[0.0, -100.0]])
    ref = t([[-100.0, 0.0]])
    # token 1: log r = -100 -> clamped to -20: k1 = 20, k3 = e^-20 - 1 + 20 = 19.000000002 -> capped to 10
    # token 2: log r = +100 -> clamped to 20:  k1 = -20, k3 = e^20 - 1 - 20 = 485165174.4 -> capped to 10
    close(kl_estimate(logp, ref, "k1"), [[20.0, -20.0]])
    close(kl_estimate(logp, ref, "k3"), [[K3_CAP, K3_CAP]])
    assert K3_CAP == 10.0  # verl's low_var_kl cap
    lp = logp.clone().requires_grad_(True)
    kl_estimate(lp, ref, "k3").sum().backward()
    assert torch.isfinite(lp.grad).all()


def test_k3_cap_keeps_values_below_it_and_stops_gradient_above():
    # log r = ln 2 -> k3 = 1 - ln 2 = 0.306853 (below the cap: unchanged, d k3 / d logp = -(r - 1) = -1)
    # log r = 3    -> k3 = e^3 - 1 - 3 = 16.0855 -> 10, no gradient (the token adds a constant)
    # log r = -9   -> k3 = e^-9 - 1 + 9 = 8.000123 (below the cap; large negative log r grows only linearly)
    logp = t([[0.0, 0.0, 0.0]]).requires_grad_(True)
    ref = t([[LN2, 3.0, -9.0]])
    k3 = kl_estimate(logp, ref, "k3")
    close(k3.detach(), [[1 - LN2, 10.0, math.exp(-9) + 8]], atol=1e-5, rtol=0)
    k3.sum().backward()
    # d k3 / d logp = -(d k3 / d log r) = -(r - 1): -1 for r = 2; 0 capped; -(e^-9 - 1) = 0.999877
    close(logp.grad, [[-1.0, 0.0, 1 - math.exp(-9)]], atol=1e-5, rtol=0)


def test_sequence_kl_units():
    # k1 per token = log pi - log ref; row 1: ln 2, -ln 2, 2 ln 2 (3 policy tokens), row 2: one token, 0.5
    logp = t([[LN2, 0.0, 2 * LN2], [0.5, 0.0, 0.0]])
    ref = t([[0.0, LN2, 0.0], [0.0, 7.0, 7.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    # episode-sum: ln 2 - ln 2 + 2 ln 2 = 2 ln 2 = 1.386294; 0.5
    close(sequence_kl(logp, ref, mask), [2 * LN2, 0.5])
    # token-mean (verl's unit): 2 ln 2 / 3 = 0.462098; 0.5 / 1 = 0.5
    close(sequence_kl(logp, ref, mask, unit="token-mean"), [2 * LN2 / 3, 0.5])
    assert KL_UNITS == ("episode-sum", "token-mean")
    with pytest.raises(ValueError, match="episode-sum, token-mean"):
        sequence_kl(logp, ref, mask, unit="sum")


def test_mask_zeroes_non_policy_tokens_and_kl_loss_aggregates():
    logp = torch.log(t([[0.5, 0.25, 0.9]]))
    ref = torch.log(t([[0.25, 0.5, 1e-30]]))  # the third token is padding with a wild ref logprob
    mask = t([[1, 1, 0]])
    close(kl_estimate(logp, ref, "k3", mask), [[0.193147, 0.306853, 0.0]], atol=1e-6, rtol=0)
    # token-mean k3: (0.193147 + 0.306853) / 2 = 0.25
    close(kl_loss(logp, ref, mask), 0.25, atol=1e-6, rtol=0)
    # k1 token-mean: (ln 2 - ln 2) / 2 = 0
    close(kl_loss(logp, ref, mask, kind="k1"), 0.0, atol=1e-6, rtol=0)


def test_kl_gradient_does_not_reach_reference():
    ref = REF.clone().requires_grad_(True)
    logp = LOGP.clone().requires_grad_(True)
    kl_loss(logp, ref, torch.ones(1, 2)).backward()
    assert ref.grad is None and logp.grad is not None


def test_kl_reward_penalty():
    rewards = t([[0.0, 1.0, 0.0]])
    kl = t([[0.1, 0.2, 0.3]]).requires_grad_(True)
    mask = t([[1, 1, 0]])
    out = kl_reward_penalty(rewards, kl, 0.5, mask)
    # 0 - 0.5 * 0.1 = -0.05; 1 - 0.5 * 0.2 = 0.9; third token not a policy token -> unchanged 0
    close(out, [[-0.05, 0.9, 0.0]])
    assert not out.requires_grad


def test_unknown_estimator_lists_valid_names():
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    with pytest.raises(UnknownNameError, match="k1, k2, k3"):
        kl_estimate(LOGP, REF, "k4")


# ---- controllers --------------------------------------------------------------------------------------------


def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(current_kl=100.0, n_steps=1000)
    assert c.value == 0.05
    d = FixedKLController(1.0)
    d.load_state_dict(c.state_dict())
    assert d.value == 0.05
    assert isinstance(c, KLController)


def test_adaptive_controller_steps_by_hand():
    c = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    # step 1: kl 9 -> error 9/6 - 1 = 0.5, clipped to 0.2; mult 1 + 0.2 * 1000 / 10000 = 1.02 -> 0.102
    c.update(9.0, n_steps=1000)
    assert c.value == pytest.approx(0.102)
    # step 2: kl 3 -> error -0.5, clipped to -0.2; mult 0.98 -> 0.102 * 0.98 = 0.09996
    c.update(3.0, n_steps=1000)
    assert c.value == pytest.approx(0.09996)
    # step 3: kl 6.6 -> error 0.1 (inside the clip); mult 1 + 0.1 * 0.1 = 1.01 -> 0.1009596
    c.update(6.6, n_steps=1000)
    assert c.value == pytest.approx(0.1009596)
    # checkpoint round trip restores the coefficient, keeps the new controller's target and horizon
    d = AdaptiveKLController(init_coef=1.0, target=3.0, horizon=500)
    d.load_state_dict(c.state_dict())
    assert d.value == pytest.approx(0.1009596) and d.target == 3.0 and d.horizon == 500


def test_adaptive_controller_validates():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, target=1.0, horizon=0)


def test_controller_registry():
    assert KL_CONTROLLERS.names() == ["adaptive", "fixed"]
    assert isinstance(make_kl_controller("fixed", 0.2), FixedKLController)
    c = make_kl_controller("adaptive", 0.2, target=1.0, horizon=100)
    assert isinstance(c, AdaptiveKLController) and c.value == 0.2
    with pytest.raises(ValueError, match="target and horizon"):
        make_kl_controller("adaptive", 0.2)
    with pytest.raises(UnknownNameError, match="adaptive, fixed"):
        make_kl_controller("pid", 0.2)
