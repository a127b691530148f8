"""Selections over scored rollouts: dynamic sampling (DAPO), ReST's rising reward threshold, DPO pairs.

Plain Python over the frozen records of `agentgrad.types` (no torch), so each rule is testable by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentgrad.types import ScoredTrajectory, TrajectoryGroup

__all__ = ["select_signal_groups", "rest_threshold", "above_threshold", "preference_pairs"]


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
