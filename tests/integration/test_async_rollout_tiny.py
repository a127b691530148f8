"""Async rollouts (`rollout.max_staleness=1`) on the tiny model: step s+1's episodes are sampled, while step s
trains, by the weights from before step s's update; their staleness is measured; k=0 is the synchronous loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_train_tiny import FAST

from agentgrad.config import build_config
from agentgrad.data.store import TrajectoryStore
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines import rl
from agentgrad.pipelines.components import build_components
from agentgrad.sinks import MemorySink
from agentgrad.types import RewardBreakdown

pytestmark = pytest.mark.slow
# A reward that an untrained policy's samples differ on (a fixed function of the sampled tokens: it only has to
# vary within a group), so every group has signal and every step updates the weights.
SHAPE = [*FAST, "algo.tasks_per_step=2", "algo.group_size=4", "algo.steps=3", "algo.zero_signal=keep",
         "reward.name=test_async_rollout_tiny:token_hash_reward", "rollout.batch_invariant=true"]


def token_hash_reward(suite, **options):
    return lambda trajectory: RewardBreakdown(outcome=(sum(trajectory.token_ids) % 7) / 7)


def _run(tmp_path, staleness: int):
    config = build_config(overrides=[*SHAPE, f"rollout.max_staleness={staleness}"])
    c = build_components(config, tmp_path / "run")
    start = {k: v.clone() for k, v in c.loaded.model.state_dict().items()}
    sink, store = MemorySink(), TrajectoryStore(tmp_path / "trajectories")
    rl.run_rl(c, RunLogger([sink], ProgressDisplay(enabled=False)), store)
    by_step = {}
    for r in store.records():
        by_step.setdefault(r.step, []).append(r.sample.trajectory)
    return c, start, sink.metrics, by_step


def _same_sampling(a, b):
    return [t.token_ids for t in a] == [t.token_ids for t in b] and [t.logprobs for t in a] == [t.logprobs for t in b]


def test_one_step_stale_rollouts_sample_with_the_weights_before_the_update(tmp_path):
    c, start, records, by_step = _run(tmp_path, 1)
    assert all(r["train/updates"] > 0 for r in records)  # every step moved the weights
    assert [r["rollout/staleness_mean"] for r in records] == [0.0, 1.0, 1.0]  # step 0 had nothing prefetched
    assert all(r["rollout/stale_dropped_groups"] == 0.0 for r in records)
    assert [{t.policy_version for t in by_step[s]} for s in range(3)] == [{0}, {0}, {1}]
    # Step 1's episodes are what the start weights (version 0) sample for step 1's tasks and seeds.
    live = {k: v.clone() for k, v in c.loaded.model.state_dict().items()}
    c.loaded.model.load_state_dict(start)
    fresh = dataclasses.replace(c, sampling_replica=None, rollout_runner=None)
    replay = [s.trajectory for g in rl.rollout_groups(fresh, rl.rl_tasks(fresh, 1), 1) for s in g.samples]
    assert _same_sampling(by_step[1], replay)
    c.loaded.model.load_state_dict(live)
    assert any(not torch.equal(live[k], start[k]) for k in live)  # the update happened (so the check can fail)


def test_staleness_zero_is_the_synchronous_loop(tmp_path):
    _, _, records, by_step = _run(tmp_path / "sync", 0)
    assert all("rollout/staleness_mean" not in r for r in records)
    assert [{t.policy_version for t in by_step[s]} for s in range(3)] == [{0}, {1}, {2}]
    _, _, _, async_steps = _run(tmp_path / "async", 1)
    assert _same_sampling(by_step[0], async_steps[0])  # same start, same first step
    assert not _same_sampling(by_step[1], async_steps[1])  # then sync samples with the updated weights
