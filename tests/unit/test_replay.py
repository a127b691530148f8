"""ReplayBuffer: FIFO eviction, deterministic uniform and reward-prioritised sampling, state round trip, mix."""

import random

import pytest

from agentgrad.data.replay import MixSchedule, ReplayBuffer, ReplayItem, groups_from_records, split_groups
from agentgrad.data.store import TrajectoryStore
from agentgrad.rewards.testing import answer_turn, make_trajectory
from agentgrad.types import RewardBreakdown, ScoredTrajectory, Task, TrajectoryGroup


def item(i: int, reward: float = 0.0) -> ReplayItem:
    task = Task(f"t{i}", "?", "1")
    s = ScoredTrajectory(make_trajectory([answer_turn("1")], task=task), RewardBreakdown(reward, (0.0,)), reward > 0)
    return ReplayItem(TrajectoryGroup(task, (s, s)), "rollout", i)


def test_fifo_eviction_keeps_the_newest():
    buf = ReplayBuffer(3)
    buf.add(item(i) for i in range(5))
    assert len(buf) == 3 and buf.evicted == 2
    assert sorted(it.added_step for it in buf.sample(10, random.Random(0))) == [2, 3, 4]


def test_uniform_sampling_is_distinct_and_deterministic_given_the_rng():
    buf = ReplayBuffer(100)
    buf.add(item(i) for i in range(20))
    a = [it.added_step for it in buf.sample(5, random.Random(7))]
    b = [it.added_step for it in buf.sample(5, random.Random(7))]
    assert a == b and len(set(a)) == 5


def test_reward_prioritised_prefers_high_reward_groups():
    buf = ReplayBuffer(100, sampling="reward", priority_temperature=0.5)
    buf.add([item(i, reward=1.0 if i < 10 else 0.0) for i in range(100)])
    rng = random.Random(0)
    picks = [it.added_step < 10 for _ in range(200) for it in buf.sample(1, rng)]
    # weights e^0 = 1 for the 10 good groups, e^-2 = 0.135 for the 90 others: P(good) = 10 / (10 + 12.2) = 0.45,
    # against 0.10 under uniform sampling.
    assert 0.35 < sum(picks) / len(picks) < 0.56
    uniform = ReplayBuffer(100)
    uniform.add([item(i, reward=1.0 if i < 10 else 0.0) for i in range(100)])
    upicks = [it.added_step < 10 for _ in range(200) for it in uniform.sample(1, rng)]
    assert sum(upicks) / len(upicks) < 0.2


def test_state_dict_round_trip_restores_contents_and_sampling():
    buf = ReplayBuffer(4, sampling="reward")
    buf.add(item(i, reward=i / 10) for i in range(6))
    restored = ReplayBuffer(4, sampling="reward")
    restored.load_state_dict(buf.state_dict())
    assert restored.evicted == 2
    assert restored.sample(3, random.Random(1)) == buf.sample(3, random.Random(1))


def test_groups_from_store_records(tmp_path):
    store = TrajectoryStore(tmp_path)
    s = item(0).group.samples[0]
    store.append([s, s, s], step=4, stage="rl", groups=["4:0", "4:1", "4:0"])
    items = groups_from_records(store.records())
    assert [len(it.group.samples) for it in items] == [2, 1] and items[0].added_step == 4


def test_mix_schedule_moves_offline_fraction_with_success():
    constant = MixSchedule(0.7)
    assert constant.fraction(0.0) == constant.fraction(1.0) == 0.7
    sched = MixSchedule(0.7, kind="success", final_offline_fraction=0.1, success_target=0.8)
    assert sched.fraction(0.0) == pytest.approx(0.7)
    assert sched.fraction(0.4) == pytest.approx(0.4)  # halfway to the target: 0.7 + (0.1 - 0.7) * 0.5
    assert sched.fraction(0.95) == pytest.approx(0.1)


def test_split_groups_caps_by_buffer_and_keeps_one_fresh_group():
    assert split_groups(10, 0.7, available=100) == (3, 7)
    assert split_groups(10, 0.7, available=2) == (8, 2)
    assert split_groups(2, 0.99, available=100) == (1, 1)
    assert split_groups(4, 1.0, available=100) == (0, 4)
