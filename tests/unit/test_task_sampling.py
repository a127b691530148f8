"""Signal-weighted task sampling (algos/task_sampling.py, `algo.task_sampling=signal`): the counts, the weights,
the weighted draw, and RL's task draw and saved state. Expected values worked out in the comments."""

from types import SimpleNamespace

import pytest

from agentgrad.algos.kl import FixedKLController
from agentgrad.algos.task_sampling import KindCounts, kind_weight, observe, signal_rate, weighted_pick
from agentgrad.backends.scoring import Scoring
from agentgrad.config import build_config
from agentgrad.pipelines import rl
from agentgrad.types import Task


def test_signal_rate_is_laplaces_rule():
    assert signal_rate(KindCounts()) == 0.5  # (0 + 1) / (0 + 2): a kind not yet seen
    assert signal_rate(KindCounts(groups=8, signal=2)) == pytest.approx(0.3)  # (2 + 1) / (8 + 2)


def test_observe_decays_every_kind_then_adds_the_steps_groups():
    counts = {"a": KindCounts(10, 5), "c": KindCounts(2, 2)}
    out = observe(counts, [("a", True), ("b", False), ("b", True)], decay=0.9)
    # a: 10 * 0.9 + 1 = 10 groups, 5 * 0.9 + 1 = 5.5 with signal; b new: 2 and 1; c only decays: 1.8 and 1.8
    assert out == {"a": KindCounts(pytest.approx(10.0), pytest.approx(5.5)), "b": KindCounts(2.0, 1.0),
                   "c": KindCounts(pytest.approx(1.8), pytest.approx(1.8))}
    assert counts["a"] == KindCounts(10, 5)  # a new mapping: the old one is left as it was


def test_kind_weight_has_a_floor():
    counts = {"solved": KindCounts(groups=98, signal=0), "mixed": KindCounts(groups=8, signal=2)}
    assert kind_weight(counts, "solved") == 0.05  # (0 + 1) / 100 = 0.01, raised to the floor
    assert kind_weight(counts, "mixed") == pytest.approx(0.3)
    assert kind_weight(counts, "unseen") == 0.5


def test_weighted_pick_is_a_function_of_its_seed_and_keeps_input_order():
    picks = weighted_pick([1.0, 2.0, 3.0, 4.0, 5.0], 3, seed=11)
    assert picks == weighted_pick([1.0, 2.0, 3.0, 4.0, 5.0], 3, seed=11)
    assert len(picks) == 3 and picks == sorted(set(picks))
    assert weighted_pick([1.0, 1.0], 5, seed=0) == [0, 1]  # asked for more than there are: all of them
    with pytest.raises(ValueError, match="positive"):
        weighted_pick([1.0, 0.0], 1, seed=0)


def test_weighted_pick_draws_in_proportion_to_weight():
    # One of [3, 1]: item 0 with probability 3/4. Two of [1, 1, 2] without replacement: item 2 first with 2/4,
    # or second after item 0 or 1 came first (1/4 each, then 2/3): 1/2 + 2 * 1/4 * 2/3 = 5/6.
    # 6,000 draws: binomial sd <= 0.0065, so 0.03 is a margin of over 4 sd.
    n = 6000
    first = sum(weighted_pick([3.0, 1.0], 1, seed) == [0] for seed in range(n)) / n
    assert first == pytest.approx(0.75, abs=0.03)
    third = sum(2 in weighted_pick([1.0, 1.0, 2.0], 2, seed) for seed in range(n)) / n
    assert third == pytest.approx(5 / 6, abs=0.03)


def _components(sampling: str) -> SimpleNamespace:
    config = build_config(overrides=[f"algo.task_sampling={sampling}", "algo.tasks_per_step=16", "algo.task_pool=4"])

    def sample_tasks(n: int, split: str, seed: int) -> list[Task]:
        # three "easy" tasks to one "hard", numbered so a draw can be told apart
        return [Task(task_id=f"{seed}-{i}", prompt="q", answer="a", suite="s",
                     metadata={"kind": "hard" if i % 4 == 0 else "easy"}) for i in range(n)]

    return SimpleNamespace(config=config, suite=SimpleNamespace(sample_tasks=sample_tasks))


def test_rl_tasks_keeps_the_kinds_with_signal():
    c = _components("signal")
    assert [t.task_id for t in rl.rl_tasks(c, 3)] == [t.task_id for t in rl.rl_tasks(_components("uniform"), 3)]
    # "easy" groups never had signal (weight: the floor, 0.05), "hard" ones always did ((40 + 1) / 42 = 0.976).
    # A pool of 64 (16 hard, 48 easy) keeps the 16 largest keys u ** (1 / w): above a threshold t, 16 * (1 -
    # t ** 1.025) hard and 48 * (1 - t ** 0.05) easy; they add up to 16 near
    # t = 0.21: ~12.5 hard kept, against 4 (a quarter) when drawing uniformly. Per step sd ~1.5, 20 steps.
    counts = {"easy": KindCounts(40, 0), "hard": KindCounts(40, 40)}
    hard = [sum(t.metadata["kind"] == "hard" for t in rl.rl_tasks(c, step, kind_counts=counts)) for step in range(20)]
    assert 11 < sum(hard) / len(hard) < 14
    assert len({t.task_id for t in rl.rl_tasks(c, 0, kind_counts=counts)}) == 16


def test_rl_state_saves_and_restores_the_kind_counts():
    def state(counts):
        return rl.RLState(rl.ONLINE_ALGORITHMS.get("grpo"), Scoring(), reference=None,
                          kl_controller=FixedKLController(0.0), critic=None, kind_counts=counts)

    saved = state({"a": KindCounts(3.5, 1.0)}).state_dict()
    restored = state({})
    restored.load_state_dict(saved)
    assert restored.kind_counts == {"a": KindCounts(3.5, 1.0)}
    uniform = state(None)  # a run without signal sampling ignores them
    uniform.load_state_dict(saved)
    assert uniform.kind_counts is None
