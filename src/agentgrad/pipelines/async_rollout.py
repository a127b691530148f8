"""Async RL rollouts with a staleness bound (`rollout.max_staleness` = k > 0; 0 is the synchronous loop).

At step s, before its update, the first rollout round of steps s+1 .. s+k not yet started is started with a
snapshot of the weights as they are then (policy version s), on one background thread (in process: on a copy of
the model; Ray: broadcast to the workers). Step s+k then trains on episodes k updates old while the next ones are
sampled: generation overlaps the update. Each episode keeps the version it was sampled with, so its staleness
(step trained - `policy_version`) is measured; a group with an episode older than k is dropped and counted
(`rollout/stale_dropped_groups`; by construction none is, unless a run changes k mid-stage). Within the bound the
PPO ratio is taken against the episodes' own sampling logprobs, so the clip bounds the k-step lag as it bounds
epochs on one batch; `mismatch.correction=on|auto` adds the bounded importance weights of the lag (it is
measured as mismatch). Tasks and sampling seeds are the step's own, as in the synchronous loop; only the weights
differ. Episodes run to their end within their own step (none is carried over half done).

Every rollout of an async stage runs on the one background thread, in order (dynamic sampling's extra rounds
too, with the live weights), so the Ray driver and the tokenizer are never used by two threads at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from agentgrad.types import TrajectoryGroup

T = TypeVar("T")
Launch = Callable[[int, int, dict], list[TrajectoryGroup]]
"""(step, policy version, weights snapshot) -> that step's first rollout round."""


class RolloutPrefetch:
    """The rollouts started ahead of their step (at most `max_staleness` of them), for steps up to `last_step`."""

    def __init__(self, max_staleness: int, last_step: int, launch: Launch) -> None:
        self.max_staleness, self.last_step, self.launch = max_staleness, last_step, launch
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentgrad-rollout")
        self.pending: dict[int, Future] = {}

    def take(self, step: int) -> list[TrajectoryGroup] | None:
        """Step `step`'s prefetched first round (waiting for it), or None when none was started."""
        future = self.pending.pop(step, None)
        return None if future is None else future.result()

    def run_now(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run a rollout on the rollout thread (after the prefetches queued before it) and wait for it."""
        return self.pool.submit(fn, *args, **kwargs).result()

    def start_ahead(self, step: int, snapshot: Callable[[], dict]) -> None:
        """Start steps step+1 .. step+max_staleness not yet started, with the weights `snapshot()` gives now (the
        policy before step `step`'s update: version `step`)."""
        ahead = [s for s in range(step + 1, min(step + self.max_staleness, self.last_step) + 1)
                 if s not in self.pending]
        if not ahead:
            return
        weights = snapshot()
        for s in ahead:
            self.pending[s] = self.pool.submit(self.launch, s, step, weights)

    def close(self) -> None:
        """Drop the rollouts nobody will train on (those not started are cancelled; a running one finishes)."""
        for future in self.pending.values():
            future.cancel()
        self.pool.shutdown(wait=True)
        self.pending.clear()


def drop_stale(groups: Sequence[TrajectoryGroup], step: int, max_staleness: int
               ) -> tuple[list[TrajectoryGroup], dict[str, float]]:
    """Groups whose every episode is at most `max_staleness` versions older than `step`, and the staleness
    metrics: mean and max over the episodes (before dropping), and the number of groups dropped."""
    ages = [step - s.trajectory.policy_version for g in groups for s in g.samples]
    kept = [g for g in groups if all(step - s.trajectory.policy_version <= max_staleness for s in g.samples)]
    return kept, {"rollout/staleness_mean": sum(ages) / max(1, len(ages)),
                  "rollout/staleness_max": float(max(ages, default=0)),
                  "rollout/stale_dropped_groups": float(len(groups) - len(kept))}
