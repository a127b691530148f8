"""Async rollouts' bookkeeping without a model: which steps start ahead with which weights, and the staleness
filter (numbers worked out in the comments)."""

from __future__ import annotations

import threading

import pytest

from agentgrad.config import build_config
from agentgrad.pipelines.async_rollout import RolloutPrefetch, drop_stale
from agentgrad.types import RewardBreakdown, ScoredTrajectory, StopReason, Task, Trajectory, TrajectoryGroup


def _group(task_id: str, versions: list[int]) -> TrajectoryGroup:
    task = Task(task_id, "q", "a")
    samples = tuple(ScoredTrajectory(Trajectory(task, (1, 2), (0, 1), (0.0, -0.5), 1, (), StopReason.ANSWERED,
                                                policy_version=v), RewardBreakdown(0.0), False) for v in versions)
    return TrajectoryGroup(task, samples)


def test_groups_past_the_bound_are_dropped_and_counted():
    # at step 5, bound 1: ages 1, 1 | 1, 2 | 0, 0 -> the middle group has an episode 2 versions old
    groups = [_group("a", [4, 4]), _group("b", [4, 3]), _group("c", [5, 5])]
    kept, m = drop_stale(groups, 5, 1)
    assert [g.task.task_id for g in kept] == ["a", "c"]
    # mean age (1 + 1 + 1 + 2 + 0 + 0) / 6 = 5 / 6; max 2; one group dropped
    assert m == {"rollout/staleness_mean": pytest.approx(5 / 6), "rollout/staleness_max": 2.0,
                 "rollout/stale_dropped_groups": 1.0}
    assert drop_stale(groups, 5, 2)[1]["rollout/stale_dropped_groups"] == 0.0


def test_steps_ahead_start_once_with_the_weights_of_their_launch():
    launched = []
    gate = threading.Event()

    def launch(step, version, weights):
        gate.wait(5)
        launched.append((step, version, weights["w"]))
        return [f"groups of step {step}"]

    prefetch = RolloutPrefetch(2, last_step=4, launch=launch)
    assert prefetch.take(0) is None  # nothing was started for the first step
    prefetch.start_ahead(0, lambda: {"w": 0})  # steps 1 and 2, with version 0's weights
    prefetch.start_ahead(1, lambda: {"w": 1})  # step 3 (2 is already on its way)
    gate.set()
    assert prefetch.take(1) == ["groups of step 1"] and prefetch.take(2) == ["groups of step 2"]
    prefetch.start_ahead(3, lambda: {"w": 3})  # step 4 is the last: 5 is never started
    assert prefetch.take(3) == ["groups of step 3"] and prefetch.take(4) == ["groups of step 4"]
    assert launched == [(1, 0, 0), (2, 0, 0), (3, 1, 1), (4, 3, 3)]
    # a rollout run now waits behind the ones queued before it, on the same thread
    assert prefetch.run_now(lambda: threading.current_thread().name).startswith("agentgrad-rollout")
    prefetch.close()


def test_async_needs_replay_off():
    with pytest.raises(Exception, match="max_staleness > 0 needs replay.enabled=false"):
        build_config(overrides=["rollout.max_staleness=1", "replay.enabled=true"])
    assert build_config(overrides=["rollout.max_staleness=2"]).rollout.max_staleness == 2
