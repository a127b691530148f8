"""KL divergence to a reference policy: per-token estimators, a loss, a reward penalty, and coefficient
controllers.

Estimators (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html) estimate
KL(pi || pi_ref) from tokens sampled from pi. With r = pi_ref(x) / pi(x) and log r = ref_logprobs - logprobs:

    "k1":  -log r                 unbiased, high variance, can be negative  (= logprobs - ref_logprobs)
    "k2":  0.5 * (log r)^2        biased (low for close policies), low variance, >= 0
    "k3":  (r - 1) - log r        unbiased, low variance, >= 0; capped at K3_CAP = 10 per token

log r is clamped to [-20, 20] before any estimator sees it: exp(20) ~ 5e8 is already a meaningless estimate,
and the clamp keeps k3's exp from overflowing to inf (and its gradient from becoming NaN) when the policy has
drifted far on one token. Gradients do not flow through clamped positions. Even so one token could reach
e^20 ~ 5e8 under k3 and swamp the batch, so k3 is also capped at 10, as verl's "low_var_kl" is (Sheng et al.
2024, "HybridFlow"; verl `core_algos.kl_penalty`): beyond it the token adds a constant and no gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from agentgrad.algos.losses import aggregate
from agentgrad.registry import Registry

__all__ = [
    "LOG_RATIO_CLAMP",
    "K3_CAP",
    "KL_UNITS",
    "sequence_kl",
    "KL_ESTIMATORS",
    "kl_estimate",
    "kl_loss",
    "kl_reward_penalty",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "KL_CONTROLLERS",
    "make_kl_controller",
]

LOG_RATIO_CLAMP = 20.0
K3_CAP = 10.0

KLEstimator = Callable[[Tensor], Tensor]
"""Maps the clamped log-ratio log r = ref_logprobs - logprobs (B, T) to a per-token KL estimate (B, T)."""

KL_ESTIMATORS: Registry[KLEstimator] = Registry("kl estimator")


@KL_ESTIMATORS.register("k1")
def _k1(log_r: Tensor) -> Tensor:
    """k1 = -log r = log pi - log pi_ref (Schulman 2020)."""
    return -log_r  # (B, T)


@KL_ESTIMATORS.register("k2")
def _k2(log_r: Tensor) -> Tensor:
    """k2 = 0.5 (log r)^2 (Schulman 2020)."""
    return 0.5 * log_r**2  # (B, T)


@KL_ESTIMATORS.register("k3")
def _k3(log_r: Tensor) -> Tensor:
    """k3 = (r - 1) - log r (Schulman 2020), at most K3_CAP; expm1 keeps precision when r is close to 1."""
    return (torch.expm1(log_r) - log_r).clamp(max=K3_CAP)  # (B, T)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3", loss_mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) with estimator `kind` from `KL_ESTIMATORS` (Schulman 2020).

    `logprobs`, `ref_logprobs`: (B, T) log-probabilities of the sampled tokens under the policy and the frozen
    reference; the reference is detached. Returns (B, T); zero where `loss_mask == 0` if a mask is given.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"ref_logprobs shape {tuple(ref_logprobs.shape)} != logprobs shape "
                         f"{tuple(logprobs.shape)}")
    estimator = KL_ESTIMATORS.get(kind)
    log_r = (ref_logprobs.detach() - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    if loss_mask is not None:
        log_r = torch.where(loss_mask > 0, log_r, torch.zeros_like(log_r))  # (B, T); every estimator is 0 at 0
    kl = estimator(log_r)  # (B, T)
    if loss_mask is not None:
        kl = torch.where(loss_mask > 0, kl, torch.zeros_like(kl))  # (B, T)
    return kl


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor, *, kind: str = "k3",
            agg: str = "token-mean", agg_norm: float | None = None) -> Tensor:
    """KL(pi || pi_ref) as a loss term (GRPO, Shao et al. 2024, eq. 4, uses "k3"): `kl_estimate` aggregated over
    the masked tokens with `losses.aggregate(agg, norm=agg_norm)`. Scalar; the caller multiplies by its
    coefficient."""
    return aggregate(kl_estimate(logprobs, ref_logprobs, kind, loss_mask), loss_mask, agg, norm=agg_norm)


KL_UNITS = ("episode-sum", "token-mean")
"""What one sequence's KL is, for the adaptive controller: "episode-sum" sums the per-token KL over the policy
tokens (Ziegler et al. 2019 measure KL of a whole sample); "token-mean" averages it (verl's `apply_kl_penalty`),
so a verl `target_kl` carries over only under "token-mean"."""


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor, *, unit: str = "episode-sum",
                kind: str = "k1") -> Tensor:
    """KL(pi || pi_ref) of each sequence (B,) from the (B, T) logprobs of its sampled tokens, in `unit` (one of
    `KL_UNITS`); a sequence without policy tokens has KL 0. k1 by default, as the controller's measurement in
    Ziegler et al. 2019 and verl."""
    if unit not in KL_UNITS:
        raise ValueError(f"unknown KL unit {unit!r}; valid: {', '.join(KL_UNITS)}")
    kl = kl_estimate(logprobs, ref_logprobs, kind, loss_mask)  # (B, T)
    total = kl.sum(dim=-1)  # (B,)
    if unit == "episode-sum":
        return total
    return total / (loss_mask > 0).sum(dim=-1).clamp(min=1)  # (B,)


def kl_reward_penalty(token_rewards: Tensor, kl: Tensor, coef: float | Tensor, loss_mask: Tensor) -> Tensor:
    """KL as a per-token reward penalty (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences", eq. 2;
    Ouyang et al. 2022, InstructGPT, eq. 2): r'_t = r_t - coef * KL_t on policy tokens, r_t elsewhere.

    `token_rewards`, `kl`, `loss_mask`: (B, T). `kl` is detached (rewards carry no gradient). Returns (B, T).
    """
    if kl.shape != token_rewards.shape or loss_mask.shape != token_rewards.shape:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)}, kl {tuple(kl.shape)} and loss_mask "
                         f"{tuple(loss_mask.shape)} must have the same shape")
    rewards = token_rewards if token_rewards.is_floating_point() else token_rewards.float()  # (B, T)
    penalty = coef * kl.detach().to(rewards.dtype)  # (B, T)
    return rewards - torch.where(loss_mask > 0, penalty, torch.zeros_like(penalty))  # (B, T)


# ---- coefficient controllers --------------------------------------------------------------------------------


@runtime_checkable
class KLController(Protocol):
    @property
    def value(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedKLController:
    """A constant KL coefficient (Ziegler et al. 2019, sec. 2.2, the fixed-beta baseline)."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self._value = float(coef)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self._value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, sec. 2.2; lm-human-preferences `AdaptiveKLController`):

        e = clip(current_kl / target - 1, -0.2, 0.2)
        coef <- coef * (1 + e * n_steps / horizon)

    `n_steps` counts what `horizon` counts (e.g. episodes in the batch that produced `current_kl`).
    `current_kl` and `target` share a unit, which the caller picks (`sequence_kl`, `KL_UNITS`): KL summed over
    an episode, or verl's per-token mean; the same target means very different coefficients under the two.
    `state_dict` saves the current coefficient (and, for reference, target and horizon); `load_state_dict`
    restores only the coefficient, so a resumed run keeps its configured target and horizon.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if init_coef < 0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        if target <= 0:
            raise ValueError(f"target KL must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self._value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self._value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self._value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._value = float(state["value"])


KLControllerFactory = Callable[..., KLController]
"""Called as factory(coef, target=..., horizon=...) -> KLController; see `make_kl_controller`."""

KL_CONTROLLERS: Registry[KLControllerFactory] = Registry("kl controller")


@KL_CONTROLLERS.register("fixed")
def _fixed(coef: float, target: float | None = None, horizon: float | None = None) -> KLController:
    """`FixedKLController(coef)`; target and horizon are ignored."""
    return FixedKLController(coef)


@KL_CONTROLLERS.register("adaptive")
def _adaptive(coef: float, target: float | None = None, horizon: float | None = None) -> KLController:
    """`AdaptiveKLController(coef, target, horizon)`; both target and horizon are required."""
    if target is None or horizon is None:
        raise ValueError("the 'adaptive' kl controller needs target and horizon")
    return AdaptiveKLController(coef, target, horizon)


def make_kl_controller(name: str, coef: float, *, target: float | None = None,
                       horizon: float | None = None) -> KLController:
    """Build a KL controller by registry name ("fixed" | "adaptive", Ziegler et al. 2019)."""
    return KL_CONTROLLERS.get(name)(coef, target=target, horizon=horizon)
