"""A run whose rollouts are nearly all failures says so once, with what to change (docs/algorithms.md)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from agentgrad.config import build_config
from agentgrad.logging import RunLogger
from agentgrad.pipelines.rl import ONLINE_STAGE
from agentgrad.pipelines.run_state import NoSignalWatch, run_alone


def metrics(success: float, zero_signal: float) -> dict[str, float]:
    return {"rollout/success_rate": success, "rollout/zero_signal_groups": zero_signal}


def test_ten_failing_steps_warn_once_naming_the_steps_and_the_temperature():
    watch = NoSignalWatch()
    # the measured case: a 4% start at temperature 0.7 sampled ~0.4% successes, 97% of groups without signal
    lines = [watch.update("grpo", step, metrics(0.004, 0.97)) for step in range(1, 21)]
    assert lines[:9] == [None] * 9
    assert lines[9] is not None and lines[9].startswith("warning: grpo steps 1-10: rollout success 0.4% and 97%")
    assert "rollout.temperature" in lines[9] and "docs/algorithms.md" in lines[9]
    assert lines[10:] == [None] * 10


def test_the_window_means_decide_not_one_step():
    watch = NoSignalWatch(window=4)
    # mean success (0 + 0 + 0 + 0.16) / 4 = 0.04 <= 0.05 and mean zero-signal (1 + 1 + 1 + 0.64) / 4 = 0.91 >= 0.9
    assert [watch.update("ppo", s, m) for s, m in enumerate(
        [metrics(0.0, 1.0)] * 3 + [metrics(0.16, 0.64)], start=1)][-1] is not None
    watch = NoSignalWatch(window=4)
    # more success in the last step: 0.24 / 4 = 0.06 > 0.05, no warning
    assert all(watch.update("ppo", s, m) is None for s, m in enumerate(
        [metrics(0.0, 1.0)] * 3 + [metrics(0.24, 0.64)], start=1))


def test_no_warning_when_groups_agree_because_they_all_succeed_or_some_signal_remains():
    solved, workable = NoSignalWatch(), NoSignalWatch()
    assert all(solved.update("grpo", s, metrics(1.0, 1.0)) is None for s in range(1, 30))
    # the T 0.3 runs from the same 4% start: 3% success, 77% of groups without signal, and they converged
    assert all(workable.update("grpo", s, metrics(0.03, 0.77)) is None for s in range(1, 30))


def test_stages_without_rollout_metrics_are_ignored():
    watch = NoSignalWatch(window=1)
    assert watch.update("bc", 1, {"loss/bc": 0.5}) is None
    assert watch.recent == type(watch.recent)([], maxlen=1)


def test_an_rl_stage_prints_the_warning_through_its_display(printed_display):
    display = printed_display
    stage = dataclasses.replace(ONLINE_STAGE, step=lambda c, logger, store, state, step: metrics(0.0, 1.0))
    c = SimpleNamespace(config=build_config(overrides=["algo.steps=12", "run.slow_step_warn_s=1e9"]))
    run_alone("grpo", stage, c, RunLogger([], display), state=object())
    assert len(display.printed) == 1 and display.printed[0].startswith("warning: grpo steps 1-10:")
