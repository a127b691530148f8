"""score() failure semantics (raise / NaN / timeout mask, never 0), composition, load_reward, metrics."""

from __future__ import annotations

import math
import textwrap
import threading
import time

import pytest

from agentgrad.envs.tasks.arithmetic import ArithmeticSuite
from agentgrad.registry import UnknownNameError
from agentgrad.rewards import (
    REWARDS,
    CombinedReward,
    OutcomeReward,
    ProcessReward,
    RewardSpecError,
    RewardTimeoutError,
    VerifierReward,
    load_reward,
    reward_metrics,
    score,
    with_timeout,
)
from agentgrad.rewards.testing import answer_turn, make_trajectory, tool_turn
from agentgrad.types import RewardBreakdown, StopReason, Task


class ExactSuite:
    name = "exact"

    def verify(self, task, answer):
        return answer is not None and answer.strip() == task.answer


SUITE = ExactSuite()
TASK = Task("t0", "2+2?", "4")
GOOD = make_trajectory([tool_turn("python", {"code": "print(2+2)"}, exit_code=0), answer_turn("4")], task=TASK)
BAD = make_trajectory([answer_turn("5")], task=TASK)


def const(outcome, process=None):
    return lambda traj: RewardBreakdown(outcome=outcome,
                                        process=tuple(process) if process else (0.0,) * len(traj.turns))


def test_outcome_reward_unchanged():
    assert REWARDS.get("outcome")(SUITE)(GOOD) == RewardBreakdown(1.0, (0.0, 0.0))
    out = score([GOOD, BAD], OutcomeReward(SUITE), SUITE)
    assert [s.total_reward for s in out] == [1.0, 0.0] and [s.success for s in out] == [True, False]


def test_raising_reward_is_masked_not_zero():
    def boom(traj):
        raise RuntimeError("grader crashed")

    [s] = score([GOOD], boom, SUITE)
    assert s.reward.masked and "RuntimeError: grader crashed" in s.reward.reason
    assert s.success  # success stays the suite's verdict


@pytest.mark.parametrize("fn", [
    lambda traj: math.nan,                                                 # a bare NaN
    lambda traj: float("inf"),
    lambda traj: RewardBreakdown(outcome=math.nan),                        # NaN refused by RewardBreakdown
    lambda traj: RewardBreakdown(outcome=1.0, process=(math.nan, 0.0)),
])
def test_non_finite_reward_is_masked(fn):
    [s] = score([GOOD], fn, SUITE)
    assert s.reward.masked and "non-finite" in s.reward.reason


@pytest.mark.parametrize("fn,why", [
    (lambda traj: "1.0", "TypeError"),
    (lambda traj: True, "TypeError"),
    (lambda traj: RewardBreakdown(1.0, (0.1,)), "1 entries for 2 turns"),
])
def test_malformed_results_are_masked(fn, why):
    [s] = score([GOOD], fn, SUITE)
    assert s.reward.masked and why in s.reward.reason


def test_plain_float_is_an_outcome():
    [s] = score([GOOD], lambda traj: 0.25, SUITE)
    assert not s.reward.masked and s.reward.outcome == 0.25 and s.reward.process == (0.0, 0.0)


def test_timeout_masks_and_does_not_block():
    release = threading.Event()

    def stuck(traj):
        release.wait(5)  # blocks like a hung HTTP call, without burning CPU
        return RewardBreakdown(1.0)

    try:
        t0 = time.monotonic()
        scored = score([GOOD, BAD], with_timeout(stuck, 0.05), SUITE)
        assert time.monotonic() - t0 < 1.0
        assert all(s.reward.masked for s in scored)
        assert "RewardTimeoutError" in scored[0].reward.reason and "0.05 s" in scored[0].reward.reason
    finally:
        release.set()


def test_with_timeout_passes_results_and_errors_through():
    fast = with_timeout(const(0.5), 2.0)
    assert fast(GOOD).outcome == 0.5

    def bad(traj):
        raise KeyError("k")

    with pytest.raises(KeyError):
        with_timeout(bad, 2.0)(GOOD)
    with pytest.raises(RewardTimeoutError):
        with_timeout(lambda t: time.sleep(0.5), 0.01)(GOOD)
    with pytest.raises(ValueError):
        with_timeout(fast, 0)


def test_combined_reward_weights_and_alignment():
    combo = CombinedReward([(const(1.0, [0.5, 0.0]), 2.0), (const(0.5, [0.0, 0.1]), -1.0), const(0.25)])
    r = combo(GOOD)
    assert r.outcome == pytest.approx(2.0 - 0.5 + 0.25)
    assert r.process == pytest.approx((1.0, -0.1))
    # a component without process rewards contributes zeros
    r2 = CombinedReward([(lambda t: RewardBreakdown(1.0), 1.0), (ProcessReward(), 1.0)])(GOOD)
    assert r2.process == pytest.approx((0.2, 0.0))


def test_combined_reward_masks_if_any_component_masks():
    def boom(traj):
        raise ValueError("bad")

    masked_component = lambda traj: RewardBreakdown(0.0, masked=True, reason="judge: no verdict")  # noqa: E731
    for bad in (boom, masked_component, lambda t: math.nan):
        [s] = score([GOOD], CombinedReward([(const(1.0), 1.0), (bad, 0.1)]), SUITE)
        assert s.reward.masked and s.reward.outcome == 0.0
    [s] = score([GOOD], CombinedReward([const(1.0), boom]), SUITE)
    assert "boom: ValueError: bad" in s.reward.reason
    with pytest.raises(ValueError):
        CombinedReward([])
    with pytest.raises(ValueError):
        CombinedReward([(const(1.0), math.inf)])


def test_load_reward_by_name_reference_and_callable(tmp_path, monkeypatch):
    suite = ArithmeticSuite()
    assert isinstance(load_reward("outcome", suite), OutcomeReward)
    v = load_reward("verifier", suite, verifier="numeric", abs_tol=0.1)
    assert isinstance(v, VerifierReward) and v(make_trajectory([answer_turn("4.05")], task=TASK)).outcome == 1.0
    cls = load_reward("agentgrad.rewards.base:OutcomeReward", SUITE)  # a class is called with (suite, **options)
    assert isinstance(cls, OutcomeReward) and cls.suite is SUITE
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        from agentgrad.types import RewardBreakdown

        def brevity(traj):
            return RewardBreakdown(outcome=1.0 / (1 + len(traj.turns)), process=(0.0,) * len(traj.turns))

        def make_bonus(suite, value=0.5):
            return lambda traj: value

        def make_kw(*, suite, value):
            return lambda traj: (suite, value)

        def make_plain(value):
            return lambda traj: value
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    brevity = load_reward("my_rewards:brevity", SUITE)  # a plain reward function, no options: as is
    assert brevity(GOOD).outcome == pytest.approx(1 / 3)
    assert load_reward("my_rewards:make_bonus", SUITE, value=0.7)(GOOD) == 0.7  # takes `suite`: a factory
    assert load_reward("my_rewards:make_bonus", SUITE)(GOOD) == 0.5
    assert load_reward("my_rewards:make_kw", SUITE, value=1)(GOOD) == (SUITE, 1)
    assert load_reward(brevity, SUITE) is brevity
    assert isinstance(load_reward(OutcomeReward, SUITE), OutcomeReward)
    with pytest.raises(RewardSpecError, match="plain reward function; a factory must take a parameter named"):
        load_reward("my_rewards:make_plain", SUITE, value=0.7)
    with pytest.raises(RewardSpecError, match="plain reward function"):
        load_reward(brevity, SUITE, value=1)
    with pytest.raises(UnknownNameError, match="valid names: env, judge, outcome, process, shaped, verifier"):
        load_reward("outcomes", SUITE)
    with pytest.raises(TypeError, match="takes no options"):
        load_reward("outcome", SUITE, cap=0.3)
    with pytest.raises(RewardSpecError, match="cannot import"):
        load_reward("no_such_module_xyz:fn", SUITE)
    with pytest.raises(RewardSpecError, match="has no attribute"):
        load_reward("my_rewards:missing", SUITE)
    with pytest.raises(RewardSpecError):
        load_reward("my_rewards:", SUITE)
    with pytest.raises(RewardSpecError, match="non-callable"):
        load_reward("textwrap:__doc__", SUITE)


class MinimalSuite:
    """The least a factory may rely on: `verify(task, answer) -> bool`."""

    def verify(self, task, answer):
        return answer == task.answer


@pytest.mark.parametrize("name", REWARDS.names())
def test_every_registered_reward_builds_from_a_suite_alone(name):
    """One signature per registry: factory(suite, **options) -> RewardFn, and factory(suite) works."""
    from agentgrad.rewards import JudgeNotCalibratedError

    factory = REWARDS.get(name)
    if name == "judge":  # a judge must be calibrated: with no report the factory refuses, saying how to fix it
        with pytest.raises(JudgeNotCalibratedError, match="not calibrated: no calibration report given.*calibrate"):
            factory(MinimalSuite(), base_url="http://127.0.0.1:9", model="m")
        with pytest.raises(ValueError, match="needs `backend`, `hf_model` .*or `base_url` and `model`"):
            factory(MinimalSuite())
        # building does not connect: a backend pointing at nothing is fine with the gate overridden
        with pytest.warns(UserWarning, match="overridden"):
            fn = factory(MinimalSuite(), base_url="http://127.0.0.1:9", model="m", override=True)
    else:
        fn = factory(MinimalSuite())
    assert callable(fn)
    if name != "judge":  # (calling the judge would try the endpoint)
        r = fn(GOOD)
        assert isinstance(r, RewardBreakdown) and len(r.process) == len(GOOD.turns)
        assert type(load_reward(name, MinimalSuite())) is type(fn)


def test_reward_metrics():
    loop = make_trajectory([tool_turn("search", {"q": "a"}, results=1)] * 3, task=TASK,
                           stop_reason=StopReason.REPEATED_CALL)
    release = threading.Event()
    try:
        scored = (score([GOOD, BAD, loop], ProcessReward(), SUITE)
                  + score([GOOD], lambda t: math.nan, SUITE)
                  + score([GOOD], lambda t: 1 / 0, SUITE)
                  + score([GOOD], with_timeout(lambda t: release.wait(5), 0.02), SUITE)
                  + score([GOOD], lambda t: RewardBreakdown(0.0, masked=True, reason="judge: unparseable verdict"),
                          SUITE))
    finally:
        release.set()
    m = reward_metrics(scored)
    assert m["reward/count"] == 7 and m["reward/masked"] == 4
    assert m["reward/masked_frac"] == pytest.approx(4 / 7)
    assert (m["reward/masked/non_finite"], m["reward/masked/error"], m["reward/masked/timeout"],
            m["reward/masked/judge"]) == (1, 1, 1, 1)
    # unmasked: GOOD (process 0.2), BAD (0.0), loop (0.1 - 0.1 - 0.1 = -0.1); outcome is 0 for ProcessReward
    assert m["reward/process_mean"] == pytest.approx((0.2 + 0.0 - 0.1) / 3)
    assert m["reward/outcome_mean"] == 0.0
    assert m["reward/total_mean"] == pytest.approx(m["reward/process_mean"])
    assert m["reward/dead_loop_penalties"] == 2  # the 2nd and 3rd identical search of `loop`
    assert m["reward/repeated_call_stops"] == 1
    assert m["reward/success_rate"] == pytest.approx(5 / 7)  # GOOD x5 succeed, BAD and loop do not
    assert reward_metrics([])["reward/masked"] == 0.0
