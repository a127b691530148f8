"""Losses: policy (PPO-clip), value, entropy, SFT, DPO, and the token aggregation they share.

Per-token inputs are (B, T), right-padded, with `loss_mask` 1 exactly on trainable policy tokens (see
`agentgrad.batch`). Values at positions where the mask is 0 never reach the result, even if they are inf or
NaN: they are selected away with `torch.where`, not multiplied by 0.

Each loss returns a frozen NamedTuple: `loss` (a scalar that carries the gradient) plus detached metric
scalars. Metrics are token means over the masked tokens whatever the aggregation mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from agentgrad.registry import Registry

__all__ = [
    "AGGREGATIONS",
    "aggregate",
    "masked_mean",
    "PolicyLoss",
    "ppo_clip_loss",
    "ValueLoss",
    "value_loss",
    "entropy_from_logits",
    "entropy_bonus",
    "sft_loss",
    "DPOLoss",
    "dpo_loss",
    "sequence_logprobs",
]

Aggregation = Callable[[Tensor, Tensor, "float | None"], Tensor]
"""(values (B, T), mask (B, T), norm) -> scalar. `norm` is the constant divisor of "seq-mean-token-sum-norm";
the other modes ignore it (one signature for the registry)."""

AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


def _masked(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    m = mask > 0  # (B, T)
    return torch.where(m, values, torch.zeros_like(values)), m  # (B, T), (B, T)


def _mean_over_sequences(per_seq: Tensor, m: Tensor) -> Tensor:
    """Mean of (B,) per-sequence values over the sequences with at least one masked token."""
    has = m.any(dim=-1)  # (B,)
    return torch.where(has, per_seq, torch.zeros_like(per_seq)).sum() / has.sum().clamp(min=1)


@AGGREGATIONS.register("token-mean")
def _token_mean(values: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:
    """Sum over all masked tokens of the batch / number of masked tokens: every token weighs the same, so long
    sequences weigh more (DAPO, Yu et al. 2025, "token-level policy gradient loss")."""
    v, m = _masked(values, mask)  # (B, T)
    return v.sum() / m.sum().clamp(min=1)


@AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(values: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:
    """Mean over each sequence's masked tokens, then mean over the sequences that have any masked token: every
    sequence weighs the same (the original GRPO objective, Shao et al. 2024, eq. 3)."""
    v, m = _masked(values, mask)  # (B, T)
    return _mean_over_sequences(v.sum(dim=-1) / m.sum(dim=-1).clamp(min=1), m)  # (B,) -> ()


@AGGREGATIONS.register("seq-mean-token-sum")
def _seq_mean_token_sum(values: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:
    """Sum over each sequence's masked tokens, then mean over the sequences that have any: a sequence weighs by
    its length, and the scale grows with it (verl's `agg_loss` mode of this name)."""
    v, m = _masked(values, mask)  # (B, T)
    return _mean_over_sequences(v.sum(dim=-1), m)  # (B,) -> ()


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(values: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:
    """Sum over all masked tokens of the batch / a constant `norm` (default T, the padded length, as verl does):
    Dr.GRPO's unbiased aggregation (Liu et al. 2025, "Understanding R1-Zero-Like Training", sec. 3.1), which
    replaces GRPO's 1/|o_i| by a constant so that neither length nor batch composition rescales a token's
    gradient. As in verl it is not divided by the number of sequences, so its scale grows with the batch."""
    v, _ = _masked(values, mask)  # (B, T)
    divisor = float(norm) if norm is not None else float(values.shape[-1])
    if divisor <= 0:
        raise ValueError(f"seq-mean-token-sum-norm needs a positive norm, got {divisor}")
    return v.sum() / divisor


def aggregate(values: Tensor, mask: Tensor, mode: str = "token-mean", *, norm: float | None = None) -> Tensor:
    """Reduce per-token `values` (B, T) over `mask` (B, T) to a scalar with an `AGGREGATIONS` mode (the names and
    the meaning of verl's `agg_loss`; sequences with no masked token are left out of the "seq-mean" means, which
    only differs from verl for such rows):

    - "token-mean": sum over masked tokens / number of masked tokens in the batch;
    - "seq-mean-token-mean": per-sequence token mean, then mean over sequences;
    - "seq-mean-token-sum": per-sequence token sum, then mean over sequences;
    - "seq-mean-token-sum-norm": sum over all masked tokens / `norm` (a constant; None: T, as verl).

    An empty mask gives 0 (still connected to the graph of `values`). Unknown modes raise `UnknownNameError`
    listing the valid ones.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}")
    return AGGREGATIONS.get(mode)(values, mask, norm)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Token mean over the masked entries (0 if none); shorthand for aggregate(values, mask, "token-mean")."""
    return _token_mean(values, mask)


# ---- policy -------------------------------------------------------------------------------------------------


class PolicyLoss(NamedTuple):
    loss: Tensor
    """Scalar to minimise."""
    clipfrac: Tensor
    """Fraction of masked tokens where the clipped surrogate was the active (pessimistic) branch."""
    approx_kl: Tensor
    """Token mean of the k3 estimate of KL(old || new): (r - 1) - log r, r = pi/pi_old (Schulman 2020)."""
    ratio_mean: Tensor
    """Token mean of r = pi/pi_old."""
    dual_clipfrac: Tensor
    """Fraction of masked tokens where the dual-clip bound was active (0 without dual clip)."""


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    agg_norm: float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLoss:
    """Clipped surrogate policy loss (PPO, Schulman et al. 2017, eq. 7), negated for minimisation:

        r = exp(logprobs - old_logprobs)
        L = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

    - asymmetric clipping `clip_high > clip_low` is DAPO's clip-higher (Yu et al. 2025);
    - `dual_clip = c > 1` (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", eq. 5)
      bounds the loss of tokens with A < 0 by c * |A|:  L = min(L, -c * A) where A < 0;
    - `is_weights` (B, T) multiply the per-token loss (off-policy correction, see `off_policy.importance_weights`);
      they are used as given (callers truncate/detach them).

    All per-token inputs are (B, T); only tokens with loss_mask == 1 count. Aggregated with
    `aggregate(agg, norm=agg_norm)`.
    """
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020), got {dual_clip}")
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("loss_mask", loss_mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if is_weights is not None and is_weights.shape != logprobs.shape:
        raise ValueError(f"is_weights shape {tuple(is_weights.shape)} != logprobs shape {tuple(logprobs.shape)}")

    m = loss_mask > 0  # (B, T)
    zeros = torch.zeros_like(logprobs)  # (B, T)
    adv = torch.where(m, advantages.detach().to(logprobs.dtype), zeros)  # (B, T)
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), zeros)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_losses1 = -adv * ratio  # (B, T)
    pg_losses2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)  # (B, T)
    clipped = pg_losses2 > pg_losses1  # (B, T)
    dual_active = torch.zeros_like(m)  # (B, T)
    if dual_clip is not None:
        pg_losses3 = -adv * dual_clip  # (B, T)
        dual_active = (adv < 0) & (pg_losses > pg_losses3)  # (B, T)
        pg_losses = torch.where(adv < 0, torch.minimum(pg_losses, pg_losses3), pg_losses)  # (B, T)
    if is_weights is not None:
        pg_losses = pg_losses * torch.where(m, is_weights.to(pg_losses.dtype), zeros)  # (B, T)
    loss = aggregate(pg_losses, loss_mask, agg, norm=agg_norm)

    with torch.no_grad():
        mf = m.to(logprobs.dtype)  # (B, T)
        k3 = torch.expm1(log_ratio.clamp(-20.0, 20.0)) - log_ratio.clamp(-20.0, 20.0)  # (B, T)
        metrics = (masked_mean(clipped.to(mf.dtype), mf), masked_mean(k3, mf), masked_mean(ratio, mf),
                   masked_mean(dual_active.to(mf.dtype), mf))
    return PolicyLoss(loss, *(x.detach() for x in metrics))


# ---- value --------------------------------------------------------------------------------------------------


class ValueLoss(NamedTuple):
    loss: Tensor
    """Scalar to minimise."""
    clipfrac: Tensor
    """Fraction of masked tokens where the clipped error was the larger (active) one."""


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    *,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    agg_norm: float | None = None,
) -> ValueLoss:
    """Clipped value loss (PPO as implemented in OpenAI baselines; Schulman et al. 2017; Andrychowicz et al.
    2021, "What Matters in On-Policy RL", sec. 3.2):

        V_clip = old_values + clip(values - old_values, -clip, clip)
        L = 0.5 * max((values - returns)^2, (V_clip - returns)^2)

    `clip=None` gives the plain 0.5 * squared error. Per-token inputs (B, T); aggregated with
    `aggregate(agg, norm=agg_norm)`.
    """
    for name, t in (("old_values", old_values), ("returns", returns), ("loss_mask", loss_mask)):
        if t.shape != values.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != values shape {tuple(values.shape)}")
    m = loss_mask > 0  # (B, T)
    zeros = torch.zeros_like(values)  # (B, T)
    v = torch.where(m, values, zeros)  # (B, T)
    v_old = torch.where(m, old_values.detach().to(values.dtype), zeros)  # (B, T)
    ret = torch.where(m, returns.detach().to(values.dtype), zeros)  # (B, T)
    vf_losses1 = (v - ret) ** 2  # (B, T)
    if clip is None:
        losses = 0.5 * vf_losses1  # (B, T)
        clipped = torch.zeros_like(m)  # (B, T)
    else:
        if clip < 0:
            raise ValueError(f"clip must be >= 0 or None, got {clip}")
        v_clipped = v_old + torch.clamp(v - v_old, -clip, clip)  # (B, T)
        vf_losses2 = (v_clipped - ret) ** 2  # (B, T)
        losses = 0.5 * torch.maximum(vf_losses1, vf_losses2)  # (B, T)
        clipped = vf_losses2 > vf_losses1  # (B, T)
    loss = aggregate(losses, loss_mask, agg, norm=agg_norm)
    clipfrac = masked_mean(clipped.to(values.dtype), m.to(values.dtype)).detach()
    return ValueLoss(loss, clipfrac)


# ---- entropy ------------------------------------------------------------------------------------------------


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution softmax(logits) at each position: (B, T, V) -> (B, T).

    H = -sum_v p_v log p_v (Shannon 1948) from log_softmax, with 0 log 0 = 0 so that -inf logits (masked
    vocabulary entries) give neither NaN values nor NaN gradients. Half-precision logits are upcast to float32.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    probs = logp.exp()  # (B, T, V)
    logp = torch.where(probs > 0, logp, torch.zeros_like(logp))  # (B, T, V) 0 log 0 = 0
    return -(probs * logp).sum(dim=-1)  # (B, T)


def entropy_bonus(entropy: Tensor, loss_mask: Tensor, agg: str = "token-mean") -> Tensor:
    """Aggregated policy entropy over the masked tokens (scalar, >= 0). PPO adds it with a positive coefficient
    to the objective (Schulman et al. 2017, eq. 9; Mnih et al. 2016), so a loss *subtracts* coef * bonus."""
    return aggregate(entropy, loss_mask, agg)


# ---- supervised ---------------------------------------------------------------------------------------------


def sft_loss(logprobs: Tensor, loss_mask: Tensor, agg: str = "token-mean") -> Tensor:
    """Negative log-likelihood of the masked tokens (behaviour cloning / SFT; maximum likelihood as in
    Pomerleau 1991 and Ouyang et al. 2022, "InstructGPT", sec. 3.5). `logprobs` (B, T) are the log-probabilities
    of the taken tokens."""
    return aggregate(-logprobs, loss_mask, agg)


def sequence_logprobs(logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Sum of the log-probabilities of each sequence's masked tokens: (B, T) -> (B,), i.e. log pi(y | x) of the
    generated part, as DPO needs (Rafailov et al. 2023, eq. 7)."""
    if logprobs.shape != loss_mask.shape:
        raise ValueError(f"logprobs shape {tuple(logprobs.shape)} != loss_mask shape {tuple(loss_mask.shape)}")
    v, _ = _masked(logprobs, loss_mask)  # (B, T)
    return v.sum(dim=-1)  # (B,)


class DPOLoss(NamedTuple):
    loss: Tensor
    """Scalar to minimise (mean over pairs)."""
    reward_margin: Tensor
    """Mean over pairs of the implicit reward margin beta * (log-ratio chosen - log-ratio rejected)."""
    reward_accuracy: Tensor
    """Fraction of pairs whose implicit chosen reward beats the rejected one."""


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> DPOLoss:
    """Direct Preference Optimization, sigmoid loss (Rafailov et al. 2023, eq. 7), with conservative label
    smoothing eps (cDPO, Mitchell 2023):

        h = beta * ((log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)))
        L = -(1 - eps) * log sigmoid(h) - eps * log sigmoid(-h)

    All inputs are (N,) sequence log-probabilities (see `sequence_logprobs`); reference ones are detached.
    """
    shapes = {tuple(t.shape) for t in (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)}
    if len(shapes) != 1 or chosen_logps.dim() != 1:
        raise ValueError(f"dpo_loss needs four (N,) tensors, got shapes {sorted(shapes)}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps.detach())  # (N,)
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps.detach())  # (N,)
    h = chosen_rewards - rejected_rewards  # (N,)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)  # (N,)
    with torch.no_grad():
        margin = h.mean()
        accuracy = (chosen_rewards > rejected_rewards).to(h.dtype).mean()
    return DPOLoss(losses.mean(), margin.detach(), accuracy.detach())
