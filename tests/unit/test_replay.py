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


def test_off_policy_correction_reweights_only_replayed_rows():
    import math

    import torch

    from agentgrad.batch import TokenBatch
    from agentgrad.config import build_config
    from agentgrad.pipelines.replay import off_policy_correction

    config = build_config(overrides=["replay.is_level=token", "replay.is_mode=truncate", "replay.is_bound=2.0"])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])  # (2, 3)
    behaviour = torch.tensor([[0.0, -1.0, -1.0], [0.0, -2.0, -0.5]])  # row 1 was sampled by an old policy mu
    prox = torch.tensor([[0.0, -1.1, -0.9], [0.0, -1.5, -1.5]])  # the current policy before the update
    batch = TokenBatch(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.long),
                       loss_mask=mask, old_logprobs=behaviour, token_rewards=torch.zeros(2, 3),
                       group_index=torch.tensor([0, 1]))
    out, metrics = off_policy_correction(config, batch, prox, torch.tensor([False, True]))
    # replayed row: w = exp(-1.5 - -2.0) = e^0.5 = 1.6487 (kept), exp(-1.5 - -0.5) = e^-1 = 0.3679
    assert torch.allclose(out.is_weights[1, 1:], torch.tensor([math.exp(0.5), math.exp(-1.0)]))
    assert torch.equal(out.is_weights[0], torch.ones(3))  # fresh row: weight 1, its own logprobs as pi_old
    assert torch.equal(out.old_logprobs[0], behaviour[0]) and torch.equal(out.old_logprobs[1], prox[1])
    assert metrics["offpolicy/is_weight_mean"] == pytest.approx((math.exp(0.5) + math.exp(-1.0)) / 2)
    assert metrics["offpolicy/is_weight_max"] == pytest.approx(math.exp(0.5))
    assert metrics["offpolicy/frac_truncated"] == 0.0
    # ESS = (1.6487 + 0.3679)^2 / (2 * (1.6487^2 + 0.3679^2)) = 4.0667 / 5.7073 = 0.7125
    assert metrics["offpolicy/ess"] == pytest.approx(0.7125, abs=1e-3)
