"""Importance weights checked against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agentgrad.algos.losses import ppo_clip_loss
from agentgrad.algos.off_policy import ISWeights, importance_weights
from agentgrad.registry import UnknownNameError


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(x, expected, **kw):
    torch.testing.assert_close(x, torch.as_tensor(expected, dtype=x.dtype), **kw)


def _token_case():
    # policy-token ratios pi/mu = 3, 0.5, 1.5; the last column is padding with garbage logprobs
    behaviour = t([[-1.0, -1.0, -1.0, 0.0]])
    logp = behaviour.clone()
    logp[0, :3] += torch.log(t([3.0, 0.5, 1.5]))
    logp[0, 3] = 40.0
    return logp, behaviour, t([[1, 1, 1, 0]])


def test_token_level_truncate():
    logp, mu, mask = _token_case()
    out = importance_weights(logp, mu, mask, level="token", mode="truncate", bound=2.0)
    assert isinstance(out, ISWeights)
    # min(w, 2): 2, 0.5, 1.5; padding 0
    close(out.weights, [[2.0, 0.5, 1.5, 0.0]])
    # raw stats: mean (3 + 0.5 + 1.5) / 3 = 1.666667; max 3
    close(out.mean, 5 / 3)
    close(out.max, 3.0)
    # ess = (sum w)^2 / (n sum w^2) = 25 / (3 * (9 + 0.25 + 2.25)) = 25 / 34.5 = 0.724638
    close(out.ess, 25 / 34.5)
    # one of three exceeds the bound
    close(out.frac_truncated, 1 / 3)


def test_token_level_mask_mode():
    logp, mu, mask = _token_case()
    out = importance_weights(logp, mu, mask, mode="mask", bound=2.0)
    # the token with w = 3 > 2 is dropped
    close(out.weights, [[0.0, 0.5, 1.5, 0.0]])
    close(out.frac_truncated, 1 / 3)


def test_sequence_level():
    mu = torch.zeros(3, 3)
    logp = torch.log(t([[2.0, 0.75, 1.0],    # sequence 0: 2 * 0.75 = 1.5
                        [3.0, 1e-3, 1.0],    # sequence 1: only the first token is a policy token -> 3
                        [5.0, 5.0, 5.0]]))   # sequence 2: masked row, no samples
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    out = importance_weights(logp, mu, mask, level="sequence", mode="truncate", bound=2.0)
    # weights broadcast on each sequence's policy tokens: 1.5, min(3, 2) = 2
    close(out.weights, [[1.5, 1.5, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # stats over the two non-empty sequences: mean (1.5 + 3) / 2 = 2.25; max 3
    # ess = 4.5^2 / (2 * (2.25 + 9)) = 20.25 / 22.5 = 0.9; one of two exceeds the bound
    close(out.mean, 2.25)
    close(out.max, 3.0)
    close(out.ess, 0.9)
    close(out.frac_truncated, 0.5)
    masked = importance_weights(logp, mu, mask, level="sequence", mode="mask", bound=2.0)
    close(masked.weights, [[1.5, 1.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_on_policy_is_all_ones_and_detached():
    logp = torch.randn(2, 4).requires_grad_(True)
    mask = t([[1, 1, 1, 0], [0, 1, 1, 1]])
    out = importance_weights(logp, logp.detach(), mask)
    assert not out.weights.requires_grad
    close(out.weights, mask)
    close(out.ess, 1.0)
    close(out.frac_truncated, 0.0)


def test_huge_log_ratio_is_finite():
    out = importance_weights(t([[500.0]]), t([[0.0]]), t([[1.0]]))
    close(out.weights, [[2.0]])
    assert math.isfinite(out.max.item())  # exp(20) after the clamp


def test_empty_mask_gives_neutral_stats():
    out = importance_weights(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2))
    close(out.weights, [[0.0, 0.0]])
    assert (out.mean.item(), out.max.item(), out.ess.item(), out.frac_truncated.item()) == (1.0, 1.0, 1.0, 0.0)


def test_weights_feed_ppo_loss():
    logp, mu, mask = _token_case()
    w = importance_weights(logp, mu, mask).weights
    adv = t([[1.0, 1.0, 1.0, 0.0]])
    # on-policy (ratio 1) surrogate per token = -A = -1, weighted by 2, 0.5, 1.5: -(2 + 0.5 + 1.5) / 3
    out = ppo_clip_loss(logp, logp.detach(), adv, mask, is_weights=w)
    close(out.loss, -4 / 3)


def test_unknown_level_mode_and_bad_bound():
    logp, mu, mask = _token_case()
    with pytest.raises(UnknownNameError, match="sequence, token"):
        importance_weights(logp, mu, mask, level="turn")
    with pytest.raises(UnknownNameError, match="mask, truncate"):
        importance_weights(logp, mu, mask, mode="clip")
    with pytest.raises(ValueError, match="bound"):
        importance_weights(logp, mu, mask, bound=0.0)
