"""The search's value model: calibration buckets by hand, the taught positions of an episode, and a critic on
the tiny model that learns Monte-Carlo returns (its error falls well past noise) and reads V at the last token."""

import pytest
import torch

from agentgrad.models.value import build_critic
from agentgrad.search.value import (
    CriticValues,
    ValueExample,
    calibration,
    calibration_metrics,
    fit_values,
    value_example,
)
from agentgrad.types import FinalAnswer, StopReason, Task, ToolCall, Trajectory, Turn


def test_calibration_buckets_by_hand():
    pairs = [(0.05, 0.0), (0.15, 1.0), (0.5, 1.0), (0.55, 0.0), (0.95, 1.0), (1.0, 1.0)]
    found = calibration(pairs, buckets=5)
    # buckets: [0, .2): 0.05, 0.15 -> pred 0.10, real 0.5; [.4, .6): 0.5, 0.55 -> pred 0.525, real 0.5;
    # [.8, 1]: 0.95, 1.0 (1.0 falls in the last bucket) -> pred 0.975, real 1.0
    assert [(b.low, b.count) for b in found] == [(0.0, 2), (0.4, 2), (0.8, 2)]
    assert [b.predicted for b in found] == pytest.approx([0.10, 0.525, 0.975])
    assert [b.realised for b in found] == pytest.approx([0.5, 0.5, 1.0])
    # ECE = (2 * 0.4 + 2 * 0.025 + 2 * 0.025) / 6 = 0.9 / 6 = 0.15
    assert calibration_metrics(pairs)["value/ece"] == pytest.approx(0.15)


def test_value_example_teaches_the_prefix_before_and_through_each_turn():
    task = Task("t", "p", "5")
    turns = (Turn(4, 7, "", ToolCall("calculator", {}), "5"), Turn(9, 11, "5", FinalAnswer("5"), None))
    traj = Trajectory(task, tuple(range(11)), (0,) * 4 + (1,) * 3 + (0,) * 2 + (1,) * 2, (0.0,) * 11, 4, turns,
                      StopReason.ANSWERED)
    example = value_example(traj, 1.0)
    # turn 1 spans tokens 4..6: V(0..3) at 3 and Q through it at 6; turn 2 spans 9..10: 8 and 10
    assert example.positions == (3, 6, 8, 10) and example.target == 1.0


def test_critic_learns_returns(loaded_tiny):
    torch.manual_seed(0)
    critic = build_critic(loaded_tiny.model, "separate", lr=3e-3)
    values = CriticValues(critic, loaded_tiny.pad_token_id)
    # Episodes that end in token 40 succeed, in token 41 fail; the prefixes before the last token are shared.
    good = [ValueExample((5, 6, 7, 8 + i, 40), (4,), 1.0) for i in range(4)]
    bad = [ValueExample((5, 6, 7, 8 + i, 41), (4,), 0.0) for i in range(4)]
    before = values([e.token_ids for e in good + bad])
    assert before == pytest.approx([0.0] * 8)  # the head starts at zero
    fitted = fit_values(critic, good + bad, loaded_tiny.pad_token_id, steps=60, batch_size=8, seed=0)
    assert fitted["value/loss_first"] == pytest.approx(0.5, abs=1e-6)  # (4 * 1 + 4 * 0) / 8 at a zero head
    assert fitted["value/loss_last"] < 0.05
    after = values([e.token_ids for e in good + bad])
    assert min(after[:4]) > 0.75 and max(after[4:]) < 0.25
    # padding does not move a value: a short sequence batched with a long one reads the same alone
    assert values([good[0].token_ids, good[0].token_ids + (1, 2, 3)])[0] == pytest.approx(after[0], abs=1e-5)
    pairs = values.predict(good + bad)
    assert len(pairs) == 8 and calibration_metrics(pairs)["value/ece"] < 0.25
