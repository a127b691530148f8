"""Train/inference mismatch: how far the sampler's logprobs (mu, recorded at rollout) are from the learner's
recomputation (pi, the same weights scored by the training forward) on the same tokens, and its correction.

The two should agree to rounding when sampler and learner run the same weights; kernels, batch shapes, dtypes, an
inference engine of its own (vLLM) or weights not yet synced make them drift. Reported per step: mean, mean
absolute and max absolute log-probability difference (pi - mu), quantiles of the per-token ratio pi/mu, and a
histogram of |pi - mu| in fixed decades. The correction is the replay path's bounded importance weights
(`off_policy.importance_weights`: truncated IS as in Yao et al. 2025 "Your Efficient RL Framework Secretly Brings
You Off-Policy RL Training", or masked), with pi_old := pi so the PPO clip is taken around the learner's own
distribution (decoupled PPO, Hilton et al. 2022).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from agentgrad.algos.off_policy import LOG_RATIO_CLAMP, ISWeights, importance_weights

__all__ = ["MismatchStats", "mismatch_stats", "mismatch_metrics", "RATIO_QUANTILES", "ABS_DIFF_EDGES",
           "correct_mismatch"]

RATIO_QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
"""Quantiles of the per-token ratio pi/mu that are logged (`mismatch/ratio_p01` ... `ratio_p99`)."""

ABS_DIFF_EDGES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
"""Histogram of |log pi - log mu| per token: buckets [0, 1e-4), [1e-4, 1e-3), ..., [1, inf)."""


class MismatchStats(NamedTuple):
    mean_diff: Tensor
    """Mean of log pi - log mu over the policy tokens (signed: > 0 when the learner is the more confident)."""
    mean_abs_diff: Tensor
    """Mean of |log pi - log mu| over the policy tokens."""
    max_abs_diff: Tensor
    """Max of |log pi - log mu| over the policy tokens."""
    ratio_quantiles: Tensor
    """(len(RATIO_QUANTILES),) quantiles of exp(log pi - log mu) over the policy tokens."""
    abs_diff_histogram: Tensor
    """(len(ABS_DIFF_EDGES) + 1,) fraction of policy tokens in each |diff| bucket; sums to 1."""
    num_tokens: int


@torch.no_grad()
def mismatch_stats(learner_logprobs: Tensor, sampler_logprobs: Tensor, loss_mask: Tensor) -> MismatchStats:
    """Statistics of log pi - log mu over the tokens where `loss_mask` (B, T) is set; all inputs (B, T).
    With no policy tokens every statistic is 0 and the histogram is all in the first bucket."""
    if sampler_logprobs.shape != learner_logprobs.shape or loss_mask.shape != learner_logprobs.shape:
        raise ValueError(f"learner_logprobs {tuple(learner_logprobs.shape)}, sampler_logprobs "
                         f"{tuple(sampler_logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} must match")
    m = loss_mask > 0  # (B, T)
    diff = (learner_logprobs.detach() - sampler_logprobs.detach())[m].double()  # (n,)
    n = diff.numel()
    if n == 0:
        zero = diff.new_zeros(())
        hist = diff.new_zeros(len(ABS_DIFF_EDGES) + 1)
        hist[0] = 1.0
        return MismatchStats(zero, zero, zero, diff.new_ones(len(RATIO_QUANTILES)), hist, 0)
    abs_diff = diff.abs()  # (n,)
    ratio = torch.exp(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (n,)
    quantiles = torch.quantile(ratio, diff.new_tensor(RATIO_QUANTILES))  # (Q,)
    bucket = torch.bucketize(abs_diff, diff.new_tensor(ABS_DIFF_EDGES), right=True)  # (n,)
    hist = torch.bincount(bucket, minlength=len(ABS_DIFF_EDGES) + 1).double() / n  # (E + 1,)
    return MismatchStats(diff.mean(), abs_diff.mean(), abs_diff.max(), quantiles, hist, n)


def _edge_name(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e")


def mismatch_metrics(stats: MismatchStats) -> dict[str, float]:
    """Flat metric keys: mismatch/mean_abs_logprob_diff, .../max_abs_logprob_diff, .../ratio_p50, and the
    histogram as .../abs_diff_lt_1e-4, .../abs_diff_1e-4_1e-3, ..., .../abs_diff_ge_1e0 (fractions of tokens)."""
    out = {"mismatch/mean_logprob_diff": stats.mean_diff.item(),
           "mismatch/mean_abs_logprob_diff": stats.mean_abs_diff.item(),
           "mismatch/max_abs_logprob_diff": stats.max_abs_diff.item(),
           "mismatch/tokens": float(stats.num_tokens)}
    for q, v in zip(RATIO_QUANTILES, stats.ratio_quantiles.tolist()):
        out[f"mismatch/ratio_p{round(q * 100):02d}"] = v
    names = ([f"lt_{_edge_name(ABS_DIFF_EDGES[0])}"]
             + [f"{_edge_name(lo)}_{_edge_name(hi)}" for lo, hi in zip(ABS_DIFF_EDGES, ABS_DIFF_EDGES[1:])]
             + [f"ge_{_edge_name(ABS_DIFF_EDGES[-1])}"])
    for name, v in zip(names, stats.abs_diff_histogram.tolist()):
        out[f"mismatch/abs_diff_{name}"] = v
    return out


def correct_mismatch(learner_logprobs: Tensor, sampler_logprobs: Tensor, loss_mask: Tensor, rows: Tensor, *,
                     level: str = "token", mode: str = "truncate", bound: float = 2.0,
                     is_weights: Tensor | None = None) -> tuple[Tensor, Tensor, ISWeights]:
    """Correct the rows selected by `rows` (B,) bool: their pi_old becomes the learner's logprobs and their
    importance weight the bounded pi/mu (`importance_weights` at `level`, `mode`, `bound`); other rows keep
    their `sampler_logprobs` and `is_weights` (1 where None). Returns (old_logprobs (B, T), is_weights (B, T),
    the ISWeights of the corrected rows)."""
    selected = rows[:, None] & (loss_mask > 0)  # (B, T)
    w = importance_weights(learner_logprobs, sampler_logprobs, selected.to(loss_mask.dtype), level=level, mode=mode,
                           bound=bound)
    kept = is_weights if is_weights is not None else torch.ones_like(w.weights)  # (B, T)
    weights = torch.where(rows[:, None], w.weights, kept)  # (B, T)
    old = torch.where(rows[:, None], learner_logprobs.detach(), sampler_logprobs)  # (B, T)
    return old, weights, w
