"""Importance weights for data sampled by a behaviour policy mu different from the policy pi being trained
(stale rollouts, a different inference engine's numerics, replayed offline logs).

w = pi(y) / mu(y), from log-probabilities, at token or sequence level, then bounded:
- "truncate": w <- min(w, bound), truncated importance sampling as in IMPALA's V-trace (Espeholt et al. 2018,
  eq. 1, rho-bar / c-bar) and the TIS fix for rollout/training mismatch (Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training");
- "mask": tokens whose weight exceeds the bound get weight 0 (dropped from the loss) instead of being clipped
  (masked importance sampling, the rejection variant discussed in the same line of work).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from agentgrad.registry import Registry

__all__ = ["ISWeights", "importance_weights", "IS_LEVELS", "IS_MODES", "LOG_RATIO_CLAMP"]

LOG_RATIO_CLAMP = 20.0
"""Log-weights are clamped to [-20, 20] before exp so a wildly off-policy sample cannot produce inf."""


class ISWeights(NamedTuple):
    weights: Tensor
    """(B, T) detached weights after bounding; 0 where loss_mask == 0. Pass as `is_weights` to the losses."""
    mean: Tensor
    """Mean of the raw (unbounded) weights over the samples (tokens or sequences, see `level`)."""
    max: Tensor
    """Max of the raw weights over the samples."""
    ess: Tensor
    """Effective sample size fraction of the raw weights, (sum w)^2 / (n sum w^2) in (0, 1] (Kong 1992)."""
    frac_truncated: Tensor
    """Fraction of samples whose raw weight exceeded `bound` (clipped in "truncate" mode, zeroed in "mask")."""


# A level maps (log_ratio (B, T) zero off-mask, mask (B, T) bool) to
# (per-token log-weights (B, T), per-sample log-weights (n,)) where the samples are what the statistics count.
Level = Callable[[Tensor, Tensor], "tuple[Tensor, Tensor]"]
IS_LEVELS: Registry[Level] = Registry("importance-weight level")


@IS_LEVELS.register("token")
def _token_level(log_ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """One weight per policy token: w_t = pi(y_t | .) / mu(y_t | .). Samples = masked tokens."""
    return log_ratio, log_ratio[mask]  # (B, T), (n_tokens,)


@IS_LEVELS.register("sequence")
def _sequence_level(log_ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """One weight per sequence, exp(sum of the log-ratios over its masked tokens), broadcast to its tokens.
    Samples = sequences with at least one masked token."""
    seq = log_ratio.sum(dim=-1)  # (B,)
    per_token = seq.unsqueeze(1).expand_as(log_ratio)  # (B, T)
    return per_token, seq[mask.any(dim=-1)]  # (B, T), (n_seqs,)


# A mode maps (raw weights, bound) to the bounded weights.
IS_MODES: Registry[Callable[[Tensor, float], Tensor]] = Registry("importance-weight mode")


@IS_MODES.register("truncate")
def _truncate(w: Tensor, bound: float) -> Tensor:
    return w.clamp(max=bound)


@IS_MODES.register("mask")
def _mask(w: Tensor, bound: float) -> Tensor:
    return torch.where(w > bound, torch.zeros_like(w), w)


@torch.no_grad()
def importance_weights(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    bound: float = 2.0,
) -> ISWeights:
    """Bounded importance weights pi/mu (truncated IS: Espeholt et al. 2018, IMPALA, sec. 4.1; Yao et al. 2025,
    TIS) for the policy tokens of a batch.

    `logprobs` (pi, the policy being trained) and `behaviour_logprobs` (mu, what sampled the tokens) are (B, T)
    log-probabilities of the taken tokens; `loss_mask` (B, T) marks the policy tokens. `level` is "token" or
    "sequence" (`IS_LEVELS`); `mode` is "truncate" or "mask" (`IS_MODES`). Everything is detached.

    Statistics run over samples: masked tokens at token level, non-empty sequences at sequence level. With no
    samples they take their on-policy values (mean = max = ess = 1, frac_truncated = 0).
    """
    level_fn = IS_LEVELS.get(level)
    mode_fn = IS_MODES.get(mode)
    if bound <= 0:
        raise ValueError(f"bound must be > 0, got {bound}")
    if behaviour_logprobs.shape != logprobs.shape or loss_mask.shape != logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, behaviour_logprobs {tuple(behaviour_logprobs.shape)} "
                         f"and loss_mask {tuple(loss_mask.shape)} must have the same shape")
    m = loss_mask > 0  # (B, T)
    zeros = torch.zeros_like(logprobs)  # (B, T)
    log_ratio = torch.where(m, logprobs.detach() - behaviour_logprobs.detach(), zeros)  # (B, T)
    tok_logw, sample_logw = level_fn(log_ratio, m)  # (B, T), (n,)
    raw = torch.exp(tok_logw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B, T)
    weights = torch.where(m, mode_fn(raw, bound), zeros)  # (B, T)

    w = torch.exp(sample_logw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (n,)
    if w.numel() == 0:
        one = logprobs.new_ones(())
        return ISWeights(weights, one, one.clone(), one.clone(), logprobs.new_zeros(()))
    ess = w.sum() ** 2 / (w.numel() * (w**2).sum())
    frac = (w > bound).to(w.dtype).mean()
    return ISWeights(weights, w.mean(), w.max(), ess, frac)
