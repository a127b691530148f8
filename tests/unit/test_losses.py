"""Losses checked against numbers worked out by hand (arithmetic in the comments), torchtune-style."""

from __future__ import annotations

import math

import pytest
import torch

from agentgrad.algos.losses import (
    AGGREGATIONS,
    DPOLoss,
    PolicyLoss,
    ValueLoss,
    aggregate,
    dpo_loss,
    entropy_bonus,
    entropy_from_logits,
    ppo_clip_loss,
    sequence_logprobs,
    sft_loss,
    value_loss,
)
from agentgrad.registry import UnknownNameError

NAN = float("nan")
INF = float("inf")


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(x, expected, **kw):
    torch.testing.assert_close(x, torch.as_tensor(expected, dtype=x.dtype), **kw)


# ---- aggregate ----------------------------------------------------------------------------------------------


def test_aggregate_modes():
    values = t([[1, 2, 3], [4, 100, NAN]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
    close(aggregate(values, mask, "token-mean"), 2.5)
    # seq-mean-token-mean: mean(mean(1, 2, 3), mean(4)) = (2 + 4) / 2 = 3
    close(aggregate(values, mask, "seq-mean-token-mean"), 3.0)
    # seq-mean-token-sum: mean(1 + 2 + 3, 4) = (6 + 4) / 2 = 5
    close(aggregate(values, mask, "seq-mean-token-sum"), 5.0)
    # seq-mean-token-sum-norm: (1 + 2 + 3 + 4) / T = 10 / 3 (verl's default divisor: the padded length)
    close(aggregate(values, mask, "seq-mean-token-sum-norm"), 10 / 3)
    # ... or a constant (Dr.GRPO's max generation length): 10 / 8 = 1.25
    close(aggregate(values, mask, "seq-mean-token-sum-norm", norm=8), 1.25)
    # the other modes ignore norm
    close(aggregate(values, mask, "token-mean", norm=8), 2.5)


def test_token_sum_norm_does_not_depend_on_padding_or_length_mix():
    # Dr.GRPO's point: with a constant divisor a token's gradient does not depend on its sequence's length or
    # on how much padding the batch has. The same two sequences padded to T = 3 and to T = 6:
    values = t([[1, 2, 3], [4, 0, 0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    wide_values = torch.cat([values, torch.full((2, 3), NAN)], dim=1)  # (2, 6): padding holds garbage
    wide_mask = torch.cat([mask, torch.zeros(2, 3)], dim=1)  # (2, 6)
    # norm 8 for both: 10 / 8 = 1.25
    close(aggregate(values, mask, "seq-mean-token-sum-norm", norm=8), 1.25)
    close(aggregate(wide_values, wide_mask, "seq-mean-token-sum-norm", norm=8), 1.25)
    # d/dv = 1 / 8 = 0.125 on every masked token, whichever sequence it is in (token-mean: 1/4; seq-mean-token-mean:
    # 1/6 for the 3-token sequence's tokens, 1/2 for the 1-token one's)
    v = values.clone().requires_grad_(True)
    aggregate(v, mask, "seq-mean-token-sum-norm", norm=8).backward()
    close(v.grad, [[0.125, 0.125, 0.125], [0.125, 0.0, 0.0]])
    v = values.clone().requires_grad_(True)
    aggregate(v, mask, "seq-mean-token-mean").backward()
    close(v.grad, [[1 / 6, 1 / 6, 1 / 6], [0.5, 0.0, 0.0]])
    with pytest.raises(ValueError, match="positive norm"):
        aggregate(values, mask, "seq-mean-token-sum-norm", norm=0)


def test_aggregate_skips_rows_without_tokens_and_empty_mask_is_zero():
    values = t([[1, 2], [9, 9]])
    mask = t([[1, 1], [0, 0]])
    # the all-zero row is not a sequence of the mean: (1 + 2) / 2 = 1.5, not 0.75
    close(aggregate(values, mask, "seq-mean-token-mean"), 1.5)
    # likewise for the token sum: (1 + 2) / 1 = 3, not 1.5
    close(aggregate(values, mask, "seq-mean-token-sum"), 3.0)
    v = values.clone().requires_grad_(True)
    for mode in AGGREGATIONS:
        out = aggregate(v, torch.zeros(2, 2), mode)
        close(out.detach(), 0.0)
        out.backward()  # still connected to the graph


def test_aggregate_unknown_mode_lists_valid_names():
    assert AGGREGATIONS.names() == ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                    "token-mean"]
    with pytest.raises(UnknownNameError, match="seq-mean-token-sum-norm, token-mean"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")


# ---- ppo clip -----------------------------------------------------------------------------------------------


def _ppo_case():
    # four tokens (ratio, advantage) plus one padding position holding garbage
    ratios = [1.5, 0.5, 0.5, 1.5]
    adv = [1.0, 1.0, -1.0, -1.0]
    old = t([[-1.0, -1.0, -1.0, -1.0, 0.0]])
    logp = old.clone()
    logp[0, :4] += torch.log(t(ratios))
    logp[0, 4] = 50.0  # exp(50 - 0) would dominate if padding leaked in
    return logp, old, t([adv + [1e6]]), t([[1, 1, 1, 1, 0]])


def test_ppo_clip_loss_by_hand():
    logp, old, adv, mask = _ppo_case()
    out = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert isinstance(out, PolicyLoss)
    # token 1: r 1.5, A +1: -min(1.5, clip(1.5)=1.2)     = -1.2   clipped
    # token 2: r 0.5, A +1: -min(0.5, clip(0.5)=0.8)     = -0.5
    # token 3: r 0.5, A -1: -min(-0.5, -0.8)             =  0.8   clipped
    # token 4: r 1.5, A -1: -min(-1.5, -1.2)             =  1.5
    # token-mean: (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.6 / 4 = 0.15
    close(out.loss, 0.15)
    close(out.clipfrac, 0.5)
    # ratio mean: (1.5 + 0.5 + 0.5 + 1.5) / 4 = 1.0
    close(out.ratio_mean, 1.0)
    # k3 = (r - 1) - log r: r=1.5 -> 0.5 - 0.405465 = 0.094535; r=0.5 -> -0.5 + 0.693147 = 0.193147
    # mean = (2 * 0.094535 + 2 * 0.193147) / 4 = 0.143841
    close(out.approx_kl, 0.143841, atol=1e-5, rtol=0)
    close(out.dual_clipfrac, 0.0)


def test_ppo_clip_loss_gradient_only_through_unclipped_tokens():
    logp, old, adv, mask = _ppo_case()
    logp = logp.clone().requires_grad_(True)
    ppo_clip_loss(logp, old, adv, mask).loss.backward()
    # d/dlogp of -A * r / N = -A * r / 4 on unclipped tokens, 0 on clipped and padding
    # token 2: -1 * 0.5 / 4 = -0.125; token 4: +1 * 1.5 / 4 = 0.375
    close(logp.grad, [[0.0, -0.125, 0.0, 0.375, 0.0]])


def test_ppo_clip_higher():
    # token 1: r 1.25, A +1; token 2: r 0.7, A -1
    old = t([[0.0, 0.0]])
    logp = torch.log(t([[1.25, 0.7]]))
    adv = t([[1.0, -1.0]])
    mask = t([[1, 1]])
    sym = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # symmetric: token 1 -> -min(1.25, 1.2) = -1.2; token 2 -> -min(-0.7, -0.8) = 0.8; mean -0.2
    close(sym.loss, -0.2)
    close(sym.clipfrac, 1.0)
    high = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # clip-higher: upper bound 1.28 -> token 1 unclipped: -1.25; token 2 unchanged 0.8; mean (-1.25 + 0.8) / 2
    close(high.loss, -0.225)
    close(high.clipfrac, 0.5)


def test_ppo_dual_clip_only_for_negative_advantages():
    old = t([[0.0, 0.0, 0.0]])
    logp = torch.log(t([[4.0, 4.0, 2.0]]))
    adv = t([[-1.0, 1.0, -1.0]])
    mask = t([[1, 1, 1]])
    out = ppo_clip_loss(logp, old, adv, mask, dual_clip=3.0)
    # token 1: r 4, A -1: PPO loss max(4, 1.2) = 4; dual: min(4, -c*A = 3) = 3   (dual active)
    # token 2: r 4, A +1: PPO loss max(-4, -1.2) = -1.2; A > 0 so no dual clip
    # token 3: r 2, A -1: PPO loss max(2, 1.2) = 2; min(2, 3) = 2                  (not active)
    # mean: (3 - 1.2 + 2) / 3 = 3.8 / 3
    close(out.loss, 3.8 / 3)
    close(out.dual_clipfrac, 1 / 3)
    plain = ppo_clip_loss(logp, old, adv, mask)
    close(plain.loss, (4 - 1.2 + 2) / 3)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, old, adv, mask, dual_clip=1.0)


def test_ppo_is_weights_scale_per_token_loss():
    old = t([[0.0, 0.0, 0.0]])
    logp = torch.log(t([[1.5, 0.5, 1.0]]))
    adv = t([[1.0, -1.0, 5.0]])
    mask = t([[1, 1, 0]])
    w = t([[0.5, 2.0, 100.0]])
    out = ppo_clip_loss(logp, old, adv, mask, is_weights=w)
    # per-token losses: -1.2 (clipped at 1.2), 0.8 (clipped at 0.8); weighted: -0.6, 1.6; mean 0.5
    close(out.loss, 0.5)


def test_ppo_seq_mean_token_mean():
    old = torch.zeros(2, 3)
    logp = torch.zeros(2, 3)  # ratio 1 -> per-token loss = -A
    adv = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    # token-mean: -(1 + 2 + 3 + 4) / 4 = -2.5; seq-mean-token-mean: -(2 + 4) / 2 = -3
    close(ppo_clip_loss(logp, old, adv, mask).loss, -2.5)
    close(ppo_clip_loss(logp, old, adv, mask, agg="seq-mean-token-mean").loss, -3.0)
    # seq-mean-token-sum: -(6 + 4) / 2 = -5; seq-mean-token-sum-norm with norm 5: -(1 + 2 + 3 + 4) / 5 = -2
    close(ppo_clip_loss(logp, old, adv, mask, agg="seq-mean-token-sum").loss, -5.0)
    close(ppo_clip_loss(logp, old, adv, mask, agg="seq-mean-token-sum-norm", agg_norm=5).loss, -2.0)


# ---- value --------------------------------------------------------------------------------------------------


def test_value_loss_clipped_by_hand():
    values = t([[1.0, 0.6, 2.0, NAN]])
    old = t([[0.5, 0.5, 1.0, 0.0]])
    returns = t([[1.0, 1.0, 1.0, 7.0]])
    mask = t([[1, 1, 1, 0]])
    out = value_loss(values, old, returns, mask, clip=0.2)
    assert isinstance(out, ValueLoss)
    # token 1: unclipped (1 - 1)^2 = 0; V_clip = 0.5 + 0.2 = 0.7 -> (0.7 - 1)^2 = 0.09; 0.5 * 0.09 = 0.045 (clipped)
    # token 2: V_clip = 0.6 (inside) -> both (0.6 - 1)^2 = 0.16; 0.5 * 0.16 = 0.08
    # token 3: unclipped (2 - 1)^2 = 1; V_clip = 1.2 -> 0.04; 0.5 * max = 0.5
    # mean: (0.045 + 0.08 + 0.5) / 3 = 0.208333
    close(out.loss, 0.625 / 3)
    close(out.clipfrac, 1 / 3)
    # no clipping: 0.5 * (0 + 0.16 + 1) / 3 = 0.193333
    close(value_loss(values, old, returns, mask, clip=None).loss, 0.58 / 3)


# ---- entropy ------------------------------------------------------------------------------------------------


def test_entropy_from_logits_by_hand():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0],
                            [0.0, math.log(3.0), -INF, -INF],
                            [1000.0, 1000.0, -1000.0, -1000.0]]])
    h = entropy_from_logits(logits)
    assert h.shape == (1, 3)
    # uniform over 4: ln 4 = 1.386294
    # probs (.25, .75): -(.25 ln .25 + .75 ln .75) = 0.346574 + 0.215762 = 0.562335
    # two equal huge logits: ln 2 = 0.693147 (no overflow)
    close(h, [[math.log(4), 0.562335, math.log(2)]], atol=1e-5, rtol=0)
    # masked (-inf) vocabulary entries give finite gradients
    z = logits.clone().requires_grad_(True)
    entropy_from_logits(z).sum().backward()
    assert torch.isfinite(z.grad).all()


def test_entropy_bonus_aggregates_masked_entropy():
    ent = t([[1.0, 3.0, NAN]])
    close(entropy_bonus(ent, t([[1, 1, 0]])), 2.0)


# ---- sft / sequence logprobs --------------------------------------------------------------------------------


def test_sft_loss_and_sequence_logprobs():
    logp = t([[-1.0, -2.0, -INF], [-3.0, NAN, -INF]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # token-mean NLL: (1 + 2 + 3) / 3 = 2; seq-mean: (1.5 + 3) / 2 = 2.25
    close(sft_loss(logp, mask), 2.0)
    close(sft_loss(logp, mask, "seq-mean-token-mean"), 2.25)
    # sums: -1 - 2 = -3; -3
    close(sequence_logprobs(logp, mask), [-3.0, -3.0])


# ---- dpo ----------------------------------------------------------------------------------------------------


def test_dpo_loss_by_hand():
    chosen, rejected = t([-1.0, -2.0]), t([-3.0, -1.0])
    ref_chosen, ref_rejected = t([-2.0, -2.0]), t([-2.0, -2.0])
    out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)
    assert isinstance(out, DPOLoss)
    # pair 1: chosen reward 0.1 * (-1 + 2) = 0.1, rejected 0.1 * (-3 + 2) = -0.1, h = 0.2
    #         loss = -log sigmoid(0.2) = log(1 + e^-0.2) = log(1.818731) = 0.598139
    # pair 2: chosen 0.1 * 0 = 0, rejected 0.1 * (-1 + 2) = 0.1, h = -0.1
    #         loss = log(1 + e^0.1) = log(2.105171) = 0.744397
    # mean = (0.598139 + 0.744397) / 2 = 0.671268; margin (0.2 - 0.1) / 2 = 0.05; accuracy 1/2
    close(out.loss, 0.671268, atol=1e-5, rtol=0)
    close(out.reward_margin, 0.05)
    close(out.reward_accuracy, 0.5)


def test_dpo_label_smoothing():
    out = dpo_loss(t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0]), beta=0.1, label_smoothing=0.1)
    # h = 0.2: 0.9 * log(1 + e^-0.2) + 0.1 * log(1 + e^0.2) = 0.9 * 0.598139 + 0.1 * 0.798139 = 0.618139
    close(out.loss, 0.618139, atol=1e-5, rtol=0)


def test_dpo_gradient_does_not_reach_reference():
    ref = t([-2.0]).requires_grad_(True)
    chosen = t([-1.0]).requires_grad_(True)
    dpo_loss(chosen, t([-3.0]), ref, t([-2.0])).loss.backward()
    assert ref.grad is None and chosen.grad is not None
