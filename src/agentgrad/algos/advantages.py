"""Advantage estimators: one signature for all of them, picked by name from `ADVANTAGE_ESTIMATORS`.

    estimator(token_rewards, loss_mask, group_index, values, params) -> AdvantageOutput

Inputs follow `agentgrad.batch` conventions: per-token tensors are (B, T) and right-padded, `loss_mask` is 1
exactly on trainable policy tokens, `token_rewards` holds each turn's process reward on that turn's last
generated token and the outcome reward on the episode's last generated token, `group_index` (B,) says which
group (task) a row belongs to. A *turn* is a maximal run of 1s in a row's `loss_mask`.

Shared choices, documented once here:
- Rewards sitting on tokens where `loss_mask == 0` are ignored (by convention there are none there).
- Rows whose `loss_mask` is all zero (masked samples, padding rows) are *invalid*: they are left out of every
  group / batch statistic and get zero advantages and returns.
- Advantages and returns are exactly 0 wherever `loss_mask == 0`, and carry no gradient.

Outcome-style estimators (grpo, rloo, reinforce_pp) work at turn granularity. With R_j the sum of the rewards
inside turn j, the return at every token of turn k is

    G_k = sum_{j >= k} gamma^(j - k) * R_j          (gamma discounts across turns, not tokens)

so with gamma = 1 and only an outcome reward, every token's return is the outcome. The episode *score* is G_0.
For grpo and rloo the group baseline is built from the scores of the group's valid rows, and the advantage at a
token of turn k is G_k - baseline (divided by the group std for grpo). Later turns therefore see a smaller
return when earlier turns earned process rewards: credit for a turn counts only what follows it.

Group statistics are computed in float64 and zero-signal groups (all valid scores equal, see
`zero_signal_groups`) get advantage exactly 0 on every token, later turns included. Without this, float32
rounding of the group mean leaves residues of ~1e-7 that the division by (std + eps) blows up to ~0.1, and
with process rewards the later turns' G_k - baseline would be divided by eps alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from agentgrad.registry import Registry

__all__ = [
    "AdvantageParams",
    "AdvantageOutput",
    "AdvantageEstimator",
    "ADVANTAGE_ESTIMATORS",
    "turn_index",
    "turn_returns",
    "masked_whiten",
    "zero_signal_groups",
    "grpo",
    "rloo",
    "reinforce_pp",
    "gae",
]


@dataclass(frozen=True)
class AdvantageParams:
    gamma: float = 1.0
    """Discount: per turn (across turns) for outcome estimators, per policy token for GAE."""
    lam: float = 0.95
    """GAE lambda (bias/variance trade-off); only GAE reads it."""
    norm_by_std: bool = True
    """grpo / reinforce_pp: divide by the (group / batch) std. False for grpo gives Dr.GRPO."""
    eps: float = 1e-6
    """Added to the std before dividing."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        if self.eps < 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")


@dataclass(frozen=True)
class AdvantageOutput:
    advantages: Tensor
    """(B, T), zero where loss_mask == 0."""
    returns: Tensor
    """(B, T): value targets for GAE (advantage + value); the per-token return G_k for outcome estimators."""


AdvantageEstimator = Callable[[Tensor, Tensor, Tensor, "Tensor | None", AdvantageParams], AdvantageOutput]

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", plugins=True, entry_point_group="agentgrad.advantage_estimators")
"""Built-in estimators by name; `algo.advantage_estimator` may also name a `module:function` or an entry point."""


# ---- helpers ------------------------------------------------------------------------------------------------


def _check_inputs(token_rewards: Tensor, loss_mask: Tensor, group_index: Tensor, values: Tensor | None) -> None:
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be (B, T), got shape {tuple(token_rewards.shape)}")
    if loss_mask.shape != token_rewards.shape:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != token_rewards shape "
                         f"{tuple(token_rewards.shape)}")
    if group_index.shape != token_rewards.shape[:1]:
        raise ValueError(f"group_index must be (B,) = ({token_rewards.shape[0]},), got {tuple(group_index.shape)}")
    if group_index.numel() and int(group_index.min()) < 0:
        raise ValueError("group_index must be non-negative")
    if values is not None and values.shape != token_rewards.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != token_rewards shape {tuple(token_rewards.shape)}")


def _float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


def turn_index(loss_mask: Tensor) -> Tensor:
    """Index of the turn each token belongs to: (B, T) long, counting from 0 per row, -1 where loss_mask == 0.

    A turn is a maximal run of 1s in `loss_mask` (observation tokens separate turns), as in `agentgrad.batch`.
    """
    pol = loss_mask > 0  # (B, T)
    prev = torch.zeros_like(pol)  # (B, T)
    prev[:, 1:] = pol[:, :-1]
    starts = pol & ~prev  # (B, T) first token of each turn
    idx = torch.cumsum(starts.long(), dim=1) - 1  # (B, T)
    return torch.where(pol, idx, torch.full_like(idx, -1))  # (B, T)


@torch.no_grad()
def turn_returns(token_rewards: Tensor, loss_mask: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """Per-token return-to-go at turn granularity, and each row's episode score.

    G_k = sum_{j >= k} gamma^(j - k) R_j with R_j the sum of the rewards inside turn j (the discounted
    return of Sutton & Barto 2018, Ch. 3, with turns as time steps). Returns (returns (B, T), zero off the
    policy tokens; scores (B,) = G_0, zero for rows without policy tokens).
    """
    rewards = _float(token_rewards)  # (B, T)
    pol = loss_mask > 0  # (B, T)
    tid = turn_index(loss_mask)  # (B, T)
    B = rewards.shape[0]
    K = int(tid.max().item()) + 1 if tid.numel() else 0
    if K == 0:
        return torch.zeros_like(rewards), rewards.new_zeros(B)
    safe_tid = tid.clamp(min=0)  # (B, T)
    per_turn = rewards.new_zeros(B, K)  # (B, K)
    per_turn.scatter_add_(1, safe_tid, torch.where(pol, rewards, torch.zeros_like(rewards)))
    G = rewards.new_zeros(B, K + 1)  # (B, K + 1), G[:, K] = 0 after the last turn
    for k in range(K - 1, -1, -1):
        G[:, k] = per_turn[:, k] + gamma * G[:, k + 1]  # (B,)
    returns = torch.where(pol, G.gather(1, safe_tid), torch.zeros_like(rewards))  # (B, T)
    return returns, G[:, 0]


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-6, *, shift_mean: bool = True,
                  scale: bool = True, unbiased: bool = False) -> Tensor:
    """(x - mean) / (std + eps) over the entries where mask is set; zero elsewhere (batch-level advantage
    normalisation, as in PPO implementations since Schulman et al. 2017's baselines; REINFORCE++, Hu 2025).

    What we compute, and where verl's `masked_whiten` differs:
    - the std is the population std (divide by n) by default; `unbiased=True` divides by n - 1 (Bessel), as verl
      does: results then differ by a factor sqrt((n - 1) / n), 0.5% at n = 100 policy tokens;
    - eps is added to the std; verl adds 1e-8 to the variance inside the root. The two differ only when the
      std is near 0, where ours gives exactly 0 for equal entries (see below);
    - `shift_mean=False` divides x itself by the std; verl's adds the mean back after whitening;
    - `scale=False` only centres (Dr.GRPO-style, no std).
    Returns zeros if the mask is empty (or, unbiased, has one entry: no variance to estimate). Statistics are
    computed in float64, so that equal entries give exactly 0 rather than float32 rounding residue divided by eps;
    the result has the dtype of `x`."""
    m = mask > 0  # (B, T)
    n = m.sum()
    if n == 0 or (unbiased and scale and n == 1):
        return torch.zeros_like(x)
    x64 = _wide(x)  # (B, T)
    zeros = torch.zeros_like(x64)  # (B, T)
    mean = torch.where(m, x64, zeros).sum() / n
    centred = x64 - mean if shift_mean else x64  # (B, T)
    if scale:
        var = torch.where(m, (x64 - mean) ** 2, zeros).sum() / (n - 1 if unbiased else n)
        centred = centred / (var.sqrt() + eps)
    return torch.where(m, centred, zeros).to(x.dtype)  # (B, T)


def _group_counts_sums(scores: Tensor, group_index: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Per-group count of valid rows and sum of their scores, (G,) each, in the dtype of `scores`."""
    num_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    counts = scores.new_zeros(num_groups).index_add_(0, group_index, valid.to(scores.dtype))  # (G,)
    sums = scores.new_zeros(num_groups).index_add_(0, group_index,
                                                   torch.where(valid, scores, torch.zeros_like(scores)))  # (G,)
    return counts, sums


@torch.no_grad()
def zero_signal_groups(scores: Tensor, group_index: Tensor, valid: Tensor, *, num_groups: int | None = None,
                       atol: float = 0.0) -> Tensor:
    """Groups whose valid scores are all equal (within `atol`): (num_groups,) bool.

    Such groups carry no learning signal for group-relative estimators (GRPO, Shao et al. 2024; RLOO,
    Ahmadian et al. 2024): every advantage in them is 0. DAPO's dynamic sampling (Yu et al. 2025) filters them.
    Groups with zero or one valid row count as zero-signal. `num_groups` defaults to max(group_index) + 1;
    group ids that never occur are reported as zero-signal.
    """
    scores = _float(scores)  # (B,)
    if num_groups is None:
        num_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    valid = valid.bool()  # (B,)
    gi, s = group_index[valid], scores[valid]  # (n,)
    hi = scores.new_full((num_groups,), float("-inf")).scatter_reduce(0, gi, s, "amax")  # (G,)
    lo = scores.new_full((num_groups,), float("inf")).scatter_reduce(0, gi, s, "amin")  # (G,)
    return ~((hi - lo) > atol)  # (G,); empty groups: -inf > atol is False -> zero-signal


def _wide(x: Tensor) -> Tensor:
    """float64 copy for group statistics (float32 on MPS, which has no float64)."""
    return x.float() if x.device.type == "mps" else x.double()


def _zero_output(token_rewards: Tensor) -> AdvantageOutput:
    z = torch.zeros_like(_float(token_rewards))
    return AdvantageOutput(advantages=z, returns=z.clone())


# ---- estimators ---------------------------------------------------------------------------------------------


class _GroupStats(NamedTuple):
    """What grpo and rloo share: per-token returns, per-row scores and the per-group sums of valid rows."""

    pol: Tensor  # (B, T) policy tokens
    returns: Tensor  # (B, T) per-token return-to-go, input dtype
    ret64: Tensor  # (B, T) the same, widened
    scores64: Tensor  # (B,) episode scores G_0, widened
    valid: Tensor  # (B,) rows with any policy token
    counts: Tensor  # (G,) valid rows per group
    sums: Tensor  # (G,) sum of valid scores per group
    has_signal: Tensor  # (B,) valid row in a group of >= 2 valid rows whose scores differ


def _group_stats(token_rewards: Tensor, loss_mask: Tensor, group_index: Tensor, gamma: float) -> _GroupStats:
    pol = loss_mask > 0  # (B, T)
    returns, scores = turn_returns(token_rewards, loss_mask, gamma)  # (B, T), (B,)
    ret64, scores64 = _wide(returns), _wide(scores)  # float64 so that equal scores cancel exactly
    valid = pol.any(dim=1)  # (B,)
    counts, sums = _group_counts_sums(scores64, group_index, valid)  # (G,), (G,)
    no_signal = zero_signal_groups(scores64, group_index, valid, num_groups=counts.shape[0])  # (G,)
    has_signal = valid & (counts[group_index] > 1) & ~no_signal[group_index]  # (B,)
    return _GroupStats(pol, returns, ret64, scores64, valid, counts, sums, has_signal)


def _keep_signal(adv: Tensor, g: _GroupStats) -> Tensor:
    """Zero advantages off the policy tokens and in groups without a baseline or a signal; input dtype."""
    keep = g.pol & g.has_signal.unsqueeze(1)  # (B, T)
    return torch.where(keep, adv, torch.zeros_like(adv)).to(g.returns.dtype)  # (B, T)


@ADVANTAGE_ESTIMATORS.register("grpo")
@torch.no_grad()
def grpo(token_rewards: Tensor, loss_mask: Tensor, group_index: Tensor, values: Tensor | None,
         params: AdvantageParams) -> AdvantageOutput:
    """Group-relative advantages: GRPO (Shao et al. 2024, DeepSeekMath, "outcome supervision") and, with
    `norm_by_std=False`, Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training").

    A_{i,k} = (G_{i,k} - mean_g(score)) / (std_g(score) + eps), with score = G_0 (see the module docstring).
    The group std is the *unbiased* sample std (Bessel's correction, n - 1), as torch.std computes it and as
    TRL, verl and OpenRLHF use. Groups with fewer than two valid rows have no baseline, and zero-signal groups
    (all valid scores equal) no signal: advantage 0 on all their tokens. `values` is ignored.
    """
    _check_inputs(token_rewards, loss_mask, group_index, values)
    if token_rewards.numel() == 0:
        return _zero_output(token_rewards)
    g = _group_stats(token_rewards, loss_mask, group_index, params.gamma)
    mean = g.sums / g.counts.clamp(min=1)  # (G,)
    dev2 = torch.where(g.valid, (g.scores64 - mean[group_index]) ** 2, torch.zeros_like(g.scores64))  # (B,)
    var = torch.zeros_like(g.sums).index_add_(0, group_index, dev2) / (g.counts - 1).clamp(min=1)  # (G,)
    adv = g.ret64 - mean[group_index].unsqueeze(1)  # (B, T)
    if params.norm_by_std:
        adv = adv / (var.sqrt()[group_index].unsqueeze(1) + params.eps)  # (B, T)
    return AdvantageOutput(advantages=_keep_signal(adv, g), returns=g.returns)


@ADVANTAGE_ESTIMATORS.register("rloo")
@torch.no_grad()
def rloo(token_rewards: Tensor, loss_mask: Tensor, group_index: Tensor, values: Tensor | None,
         params: AdvantageParams) -> AdvantageOutput:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019).

    A_{i,k} = G_{i,k} - (sum_{j != i} score_j) / (n - 1) over the n valid rows j of i's group, with
    score = G_0. No std scaling (`norm_by_std` is ignored). Groups with fewer than two valid rows have no
    leave-one-out baseline, and zero-signal groups (all valid scores equal) no signal: advantage 0 on all their
    tokens. `values` is ignored.
    """
    _check_inputs(token_rewards, loss_mask, group_index, values)
    if token_rewards.numel() == 0:
        return _zero_output(token_rewards)
    g = _group_stats(token_rewards, loss_mask, group_index, params.gamma)
    n = g.counts[group_index]  # (B,)
    baseline = (g.sums[group_index] - g.scores64) / (n - 1).clamp(min=1)  # (B,)
    adv = g.ret64 - baseline.unsqueeze(1)  # (B, T)
    return AdvantageOutput(advantages=_keep_signal(adv, g), returns=g.returns)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
@torch.no_grad()
def reinforce_pp(token_rewards: Tensor, loss_mask: Tensor, group_index: Tensor, values: Tensor | None,
                 params: AdvantageParams) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs").

    A = (G - mean_batch(G)) / (std_batch(G) + eps), where mean and std run over all valid policy tokens of
    the batch (global batch normalisation; population std, no Bessel correction, as in OpenRLHF). With
    `norm_by_std=False` only the mean is subtracted. `group_index` and `values` are ignored. A KL penalty,
    if wanted, belongs in `token_rewards` beforehand (`kl.kl_reward_penalty`).
    """
    _check_inputs(token_rewards, loss_mask, group_index, values)
    returns, _ = turn_returns(token_rewards, loss_mask, params.gamma)  # (B, T)
    adv = masked_whiten(returns, loss_mask, params.eps, scale=params.norm_by_std)  # (B, T)
    return AdvantageOutput(advantages=adv, returns=returns)


@ADVANTAGE_ESTIMATORS.register("gae")
@torch.no_grad()
def gae(token_rewards: Tensor, loss_mask: Tensor, group_index: Tensor, values: Tensor | None,
        params: AdvantageParams) -> AdvantageOutput:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", eq. 16).

    The time axis is the sequence of *policy tokens* of a row: observation tokens (loss_mask == 0) are skipped,
    so the last token of one turn bootstraps from the value of the first token of the next turn. After the
    last policy token the value is 0 (terminal). Per policy step t with next policy step t':

        delta_t = r_t + gamma * V_{t'} - V_t,    A_t = delta_t + gamma * lam * A_{t'},    returns_t = A_t + V_t

    `values` (B, T) is required (a critic's estimate at each token) and is detached. Advantages are not
    whitened here; use `masked_whiten` if the recipe wants it. `group_index` is ignored.
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values (B, T) from a critic; got values=None")
    _check_inputs(token_rewards, loss_mask, group_index, values)
    rewards = _float(token_rewards)  # (B, T)
    pol = loss_mask > 0  # (B, T)
    B, T = rewards.shape
    if B == 0 or T == 0:
        return _zero_output(token_rewards)
    vals = values.detach().to(rewards.dtype)  # (B, T)
    zeros = torch.zeros_like(rewards)  # (B, T)
    # Compact each row's policy tokens to the left, keeping their order (stable sort puts 0-keys first).
    order = torch.sort((~pol).to(torch.int8), dim=1, stable=True).indices  # (B, T) a permutation per row
    m = pol.gather(1, order).to(rewards.dtype)  # (B, T) a prefix of 1s
    r = torch.where(pol, rewards, zeros).gather(1, order)  # (B, T)
    v = torch.where(pol, vals, zeros).gather(1, order)  # (B, T)
    L = int(pol.sum(dim=1).max().item())
    adv_c = torch.zeros_like(rewards)  # (B, T)
    next_adv = rewards.new_zeros(B)  # (B,)
    next_val = rewards.new_zeros(B)  # (B,)
    next_m = rewards.new_zeros(B)  # (B,)
    for t in range(L - 1, -1, -1):
        delta = r[:, t] + params.gamma * next_val * next_m - v[:, t]  # (B,)
        next_adv = (delta + params.gamma * params.lam * next_m * next_adv) * m[:, t]  # (B,)
        adv_c[:, t] = next_adv
        next_val, next_m = v[:, t], m[:, t]
    adv = torch.zeros_like(rewards).scatter_(1, order, adv_c)  # (B, T) back to token positions
    adv = torch.where(pol, adv, zeros)  # (B, T)
    returns = torch.where(pol, adv + vals, zeros)  # (B, T)
    return AdvantageOutput(advantages=adv, returns=returns)
