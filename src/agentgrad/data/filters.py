"""Selections over scored rollouts: dynamic sampling (DAPO), ReST's rising reward threshold, DPO pairs.

Plain Python over the frozen records of `agentgrad.types` (no torch), so each rule is testable by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentgrad.types import ScoredTrajectory, TrajectoryGroup

__all__ = ["select_signal_groups", "rest_threshold", "above_threshold", "per_task_cap", "preference_pairs"]


def select_signal_groups(groups: Sequence[TrajectoryGroup], max_groups: int) -> list[TrajectoryGroup]:
    """The first `max_groups` groups that carry signal (not `is_zero_signal`), in sampling order.

    DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2) over-samples and keeps groups whose accuracy is neither
    0 nor 1 until the batch is full; with binary rewards that is exactly "not zero-signal". Keeping sampling
    order (rather than, say, the groups with the most variance) leaves the kept batch an unbiased sample of
    the tasks that have signal.
    """
    if max_groups < 0:
        raise ValueError(f"max_groups must be >= 0, got {max_groups}")
    return [g for g in groups if not g.is_zero_signal][:max_groups]


def rest_threshold(iteration: int, *, start: float, increment: float, maximum: float) -> float:
    """ReST's Improve filter threshold at Grow/Improve `iteration` (0-based): start + iteration * increment,
    capped at `maximum` (Gulcehre et al. 2023, "Reinforced Self-Training", sec. 2: tau_1 < tau_2 < ...)."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return min(start + iteration * increment, maximum)


def above_threshold(samples: Sequence[ScoredTrajectory], threshold: float) -> list[ScoredTrajectory]:
    """Unmasked samples whose total reward is >= `threshold` (the ReST Improve filter)."""
    return [s for s in samples if not s.reward.masked and s.total_reward >= threshold]


def per_task_cap(groups: Sequence[TrajectoryGroup], kept: Sequence[ScoredTrajectory], *, max_per_task: int | None,
                 dedup: bool) -> list[ScoredTrajectory]:
    """The `kept` samples, at most `max_per_task` per group (None: no cap), in sampling order; with `dedup`, a
    sample whose tokens repeat an earlier kept sample of its group is dropped first.

    ReST-EM (Singh et al. 2023, sec. 5) caps the correct solutions kept per problem so that easy problems, which
    every sample solves, do not dominate the fine-tuning set; identical copies of one episode add nothing but
    that weight. `kept` is matched to groups by identity, so it must hold samples of `groups`."""
    if max_per_task is not None and max_per_task < 1:
        raise ValueError(f"max_per_task must be >= 1 or None, got {max_per_task}")
    chosen = {id(s) for s in kept}
    out: list[ScoredTrajectory] = []
    for g in groups:
        seen: set[tuple[int, ...]] = set()
        mine = []
        for s in g.samples:
            if id(s) not in chosen or (dedup and s.trajectory.token_ids in seen):
                continue
            seen.add(s.trajectory.token_ids)
            mine.append(s)
        out += mine[:max_per_task]
    return out


def preference_pairs(groups: Sequence[TrajectoryGroup]) -> list[tuple[ScoredTrajectory, ScoredTrajectory]]:
    """(chosen, rejected) pairs for DPO: a successful and a failed trajectory of the same task.

    Within each group the i-th success is paired with the i-th failure (sampling order), so each trajectory
    is used at most once and a group gives min(#successes, #failures) pairs. Masked samples never pair.
    """
    pairs = []
    for g in groups:
        wins = [s for s in g.samples if not s.reward.masked and s.success]
        losses = [s for s in g.samples if not s.reward.masked and not s.success]
        pairs += list(zip(wins, losses))
    return pairs
