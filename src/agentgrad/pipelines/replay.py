"""Hybrid online/offline RL: the replay buffer, the per-step mix, and the off-policy correction of a batch.

Replayed samples were drawn by an older policy mu (their stored `logprobs`). Following decoupled PPO (Hilton
et al. 2022, "Batch size-invariance for policy optimization", sec. 3), the clip is taken around the current
policy before the update (pi_prox, scored once per step), and the change of sampling distribution is corrected
with bounded importance weights pi_prox / mu (`algos.off_policy.importance_weights`: token or sequence level,
truncated as in IMPALA/TIS or masked). Fresh rows keep their own logprobs as pi_old and weight 1.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from agentgrad.algos.off_policy import importance_weights
from agentgrad.batch import TokenBatch
from agentgrad.config import Config, ReplayConfig
from agentgrad.data.replay import MixSchedule, ReplayBuffer, ReplayItem, groups_from_records, split_groups
from agentgrad.data.store import TrajectoryStore
from agentgrad.types import TrajectoryGroup


def build_replay(config: Config) -> ReplayBuffer | None:
    r = config.replay
    if not r.enabled:
        return None
    buffer = ReplayBuffer(r.capacity_groups, sampling=r.sampling, priority_temperature=r.priority_temperature)
    for path in r.offline_paths:
        buffer.add(groups_from_records(TrajectoryStore(path).records()))
    return buffer


def mix_schedule(r: ReplayConfig) -> MixSchedule:
    return MixSchedule(r.offline_fraction, r.schedule, r.final_offline_fraction, r.success_target)


def plan_step(config: Config, buffer: ReplayBuffer | None, success_ema: float) -> tuple[int, int]:
    """(fresh, replayed) groups for this step."""
    total = config.algo.tasks_per_step
    if buffer is None:
        return total, 0
    return split_groups(total, mix_schedule(config.replay).fraction(success_ema), len(buffer))


def sample_replay(config: Config, buffer: ReplayBuffer | None, n: int, step: int) -> list[TrajectoryGroup]:
    if buffer is None or n == 0:
        return []
    rng = random.Random((config.run.seed + 3) * 1_000_033 + step)  # depends only on (seed, step)
    return [item.group for item in buffer.sample(n, rng)]


def add_fresh(config: Config, buffer: ReplayBuffer | None, groups: Sequence[TrajectoryGroup], step: int) -> None:
    if buffer is not None and config.replay.add_fresh:
        buffer.add(ReplayItem(g, "rollout", step) for g in groups)


def update_success_ema(config: Config, ema: float | None, success_rate: float) -> float:
    a = config.replay.success_ema
    return success_rate if ema is None else (1 - a) * ema + a * success_rate


def off_policy_correction(config: Config, batch: TokenBatch, prox_logprobs: torch.Tensor, replayed: torch.Tensor
                          ) -> tuple[TokenBatch, dict[str, float]]:
    """Replayed rows (`replayed` (B,) bool): pi_old := pi_prox (the current policy, (B, T)), and
    is_weights := bounded pi_prox / mu with mu their stored behaviour logprobs. Fresh rows: weight 1."""
    r = config.replay
    rows = replayed[:, None] & (batch.loss_mask > 0)  # (B, T)
    w = importance_weights(prox_logprobs, batch.old_logprobs, rows.to(batch.loss_mask.dtype), level=r.is_level,
                           mode=r.is_mode, bound=r.is_bound)
    weights = torch.where(replayed[:, None], w.weights, torch.ones_like(w.weights))  # (B, T)
    old = torch.where(replayed[:, None], prox_logprobs, batch.old_logprobs)  # (B, T)
    metrics = {"offpolicy/is_weight_mean": w.mean.item(), "offpolicy/is_weight_max": w.max.item(),
               "offpolicy/ess": w.ess.item(), "offpolicy/frac_truncated": w.frac_truncated.item(),
               "offpolicy/replayed_fraction": float(replayed.float().mean())}
    return batch.replace(old_logprobs=old, is_weights=weights), metrics
