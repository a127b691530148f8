"""Reward functions are plain callables: Trajectory -> RewardBreakdown.

`score` applies one to a list of trajectories with the failure semantics every caller relies on: a reward
function that raises or returns a non-finite number masks that sample (excluded from the loss, counted),
it is never scored 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from agentgrad.envs.base import TaskSuite
from agentgrad.registry import Registry
from agentgrad.types import RewardBreakdown, ScoredTrajectory, Trajectory


class RewardFn(Protocol):
    def __call__(self, trajectory: Trajectory) -> RewardBreakdown: ...


REWARDS: Registry[Callable[..., RewardFn]] = Registry("reward function")


@dataclass(frozen=True)
class OutcomeReward:
    """1.0 when the suite's verifier accepts the final answer, else 0.0; no process rewards."""

    suite: TaskSuite

    def __call__(self, trajectory: Trajectory) -> RewardBreakdown:
        correct = self.suite.verify(trajectory.task, trajectory.final_answer)
        return RewardBreakdown(outcome=1.0 if correct else 0.0, process=(0.0,) * len(trajectory.turns))


REWARDS.add("outcome", OutcomeReward)


def score(trajectories: Sequence[Trajectory], reward_fn: RewardFn, suite: TaskSuite) -> list[ScoredTrajectory]:
    """Apply `reward_fn`; success is always the suite's verifier (a shaped reward must not redefine success)."""
    out = []
    for traj in trajectories:
        try:
            reward = reward_fn(traj)
            if not isinstance(reward, RewardBreakdown):
                raise TypeError(f"reward function returned {type(reward).__name__}, not RewardBreakdown")
        except Exception as exc:  # a failing reward masks the sample; it is never a silent 0
            reward = RewardBreakdown(outcome=0.0, masked=True, reason=f"{type(exc).__name__}: {exc}"[:200])
        if not reward.masked and not math.isfinite(reward.total):
            reward = RewardBreakdown(outcome=0.0, masked=True, reason="non-finite reward")
        out.append(ScoredTrajectory(traj, reward, success=suite.verify(traj.task, traj.final_answer)))
    return out
