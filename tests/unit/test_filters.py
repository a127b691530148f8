"""Dynamic sampling selection, ReST threshold schedule and filter, DPO pairs: hand-checked."""

import pytest

from agentgrad.data.filters import (
    above_threshold,
    per_task_cap,
    preference_pairs,
    rest_threshold,
    select_signal_groups,
)
from agentgrad.types import RewardBreakdown, ScoredTrajectory, StopReason, Task, Trajectory, TrajectoryGroup


def _s(task: Task, reward: float, *, masked: bool = False, tag: int = 0) -> ScoredTrajectory:
    traj = Trajectory(task=task, token_ids=(1, 2), loss_mask=(0, 1), logprobs=(0.0, -0.5), prompt_length=1,
                      turns=(), stop_reason=StopReason.ANSWERED, sample_index=tag)
    return ScoredTrajectory(traj, RewardBreakdown(reward, masked=masked), success=reward >= 1.0 and not masked)


def _g(name: str, rewards, masked=()) -> TrajectoryGroup:
    t = Task(name, "p", "a")
    return TrajectoryGroup(t, tuple(_s(t, r, masked=i in masked, tag=i) for i, r in enumerate(rewards)))


def test_select_signal_groups_keeps_sampling_order_and_caps():
    groups = [_g("all-fail", [0, 0]), _g("a", [1, 0]), _g("all-win", [1, 1]), _g("b", [0, 1]), _g("c", [1, 0])]
    assert [g.task.task_id for g in select_signal_groups(groups, 2)] == ["a", "b"]
    assert [g.task.task_id for g in select_signal_groups(groups, 10)] == ["a", "b", "c"]
    assert select_signal_groups(groups, 0) == []
    # A group whose only differing sample is masked has no signal: {0} among the unmasked.
    assert select_signal_groups([_g("m", [0, 1], masked={1})], 5) == []
    with pytest.raises(ValueError):
        select_signal_groups(groups, -1)


def test_rest_threshold_rises_then_caps():
    # start 0.2, +0.3 per iteration, cap 0.9: 0.2, 0.5, 0.8, min(1.1, 0.9) = 0.9, 0.9
    got = [rest_threshold(i, start=0.2, increment=0.3, maximum=0.9) for i in range(5)]
    assert got == pytest.approx([0.2, 0.5, 0.8, 0.9, 0.9])
    with pytest.raises(ValueError):
        rest_threshold(-1, start=0.0, increment=0.1, maximum=1.0)


def test_above_threshold_is_inclusive_and_drops_masked():
    t = Task("t", "p", "a")
    samples = [_s(t, 0.4), _s(t, 0.5), _s(t, 1.0), _s(t, 1.0, masked=True)]
    assert [s.total_reward for s in above_threshold(samples, 0.5)] == [0.5, 1.0]


def test_per_task_cap_keeps_the_first_distinct_passing_samples_of_each_task():
    t, u = Task("t", "p", "a"), Task("u", "p", "a")

    def s(task: Task, tokens: tuple[int, ...], reward: float, tag: int) -> ScoredTrajectory:
        traj = Trajectory(task=task, token_ids=tokens, loss_mask=(0,) * len(tokens), logprobs=(0.0,) * len(tokens),
                          prompt_length=1, turns=(), stop_reason=StopReason.ANSWERED, sample_index=tag)
        return ScoredTrajectory(traj, RewardBreakdown(reward), success=reward >= 1.0)

    # task t: samples 0 and 2 are the same episode, 1 failed, 3 and 4 are distinct wins; task u: one win
    g_t = TrajectoryGroup(t, (s(t, (1, 2), 1.0, 0), s(t, (1, 3), 0.0, 1), s(t, (1, 2), 1.0, 2), s(t, (1, 4), 1.0, 3),
                              s(t, (1, 5), 1.0, 4)))
    g_u = TrajectoryGroup(u, (s(u, (1, 2), 1.0, 0),))  # same tokens as t's sample 0: another task, so kept
    passed = above_threshold([x for g in (g_t, g_u) for x in g.samples], 1.0)  # t: 0, 2, 3, 4; u: 0

    def tags(kept):
        return [(x.trajectory.task.task_id, x.trajectory.sample_index) for x in kept]

    assert tags(per_task_cap([g_t, g_u], passed, max_per_task=None, dedup=False)) == [
        ("t", 0), ("t", 2), ("t", 3), ("t", 4), ("u", 0)]
    # dedup drops t's sample 2 (a copy of 0); the cap of 2 then keeps 0 and 3 of t's distinct wins 0, 3, 4
    assert tags(per_task_cap([g_t, g_u], passed, max_per_task=None, dedup=True)) == [("t", 0), ("t", 3), ("t", 4),
                                                                                    ("u", 0)]
    assert tags(per_task_cap([g_t, g_u], passed, max_per_task=2, dedup=True)) == [("t", 0), ("t", 3), ("u", 0)]
    assert tags(per_task_cap([g_t, g_u], passed, max_per_task=2, dedup=False)) == [("t", 0), ("t", 2), ("u", 0)]
    with pytest.raises(ValueError):
        per_task_cap([g_t], passed, max_per_task=0, dedup=True)


def test_preference_pairs_match_ith_win_with_ith_loss_within_a_task():
    g1 = _g("x", [1, 0, 1, 0, 0])  # wins at 0, 2; losses at 1, 3, 4 -> pairs (0, 1), (2, 3)
    g2 = _g("y", [1, 1])  # no failure: no pair
    g3 = _g("z", [0, 1], masked={1})  # the only win is masked: no pair
    pairs = preference_pairs([g1, g2, g3])
    assert [(w.trajectory.sample_index, lose.trajectory.sample_index) for w, lose in pairs] == [(0, 1), (2, 3)]
    assert all(w.trajectory.task.task_id == lose.trajectory.task.task_id == "x" for w, lose in pairs)
