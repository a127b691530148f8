"""BC never clones expert demonstrations that the rollout limits cut short: a rare one is dropped and counted,
more than MAX_DROPPED_SHARE is an error that says which limit to raise."""

from types import SimpleNamespace

import pytest

from agentgrad.pipelines.bc import DemoLimitError, check_demos_fit
from agentgrad.pipelines.demos import MAX_DROPPED_SHARE, expert_demos
from agentgrad.rollout.loop import EpisodeLimits, SamplerSettings, expert_trajectory
from agentgrad.types import ToolCall


def test_demos_that_do_not_fit_the_limits_fail_fast(arithmetic_suite, codec):
    task = arithmetic_suite.sample_tasks(1, split="train", seed=0)[0]
    actions = arithmetic_suite.expert_actions(task)
    env = arithmetic_suite.make_env()
    check_demos_fit([expert_trajectory(env, task, actions, codec, EpisodeLimits())], EpisodeLimits())

    cut = expert_trajectory(env, task, actions, codec, EpisodeLimits(max_turns=1))
    with pytest.raises(DemoLimitError, match="rollout.max_turns=1"):
        check_demos_fit([cut], EpisodeLimits(max_turns=1))
    tight = EpisodeLimits(max_new_tokens_per_turn=4)
    with pytest.raises(DemoLimitError, match="rollout.max_new_tokens_per_turn=4"):
        check_demos_fit([expert_trajectory(env, task, actions, codec, tight)], tight)


class _Detour:
    """The arithmetic suite, but the expert of the tasks named in `detour` first makes three extra calls: 5 turns,
    so the default rollout.max_turns=4 stops them after 4."""

    def __init__(self, suite, detour: set[str]) -> None:
        self.suite, self.detour = suite, detour
        self.sample_tasks, self.make_env = suite.sample_tasks, suite.make_env

    def expert_actions(self, task):
        actions = self.suite.expert_actions(task)
        extra = [ToolCall("calculator", {"expression": f"{i} + 1"}) for i in range(3)]
        return extra + actions if task.task_id in self.detour else actions


class _Logger:
    def __init__(self) -> None:
        self.records, self.printed = [], []
        self.display = SimpleNamespace(print=self.printed.append)

    def log(self, step, stage, metrics):
        self.records.append((step, stage, dict(metrics)))


def _components(arithmetic_suite, codec, n_detours: int, n: int = 200):
    tasks = arithmetic_suite.sample_tasks(n, split="train", seed=3)
    suite = _Detour(arithmetic_suite, {t.task_id for t in tasks[:n_detours]})
    return SimpleNamespace(suite=suite, codec=codec, limits=EpisodeLimits(), sampler=SamplerSettings(), tool_head=None)


def test_a_rare_demo_that_does_not_fit_is_dropped_counted_and_warned(arithmetic_suite, codec):
    # 2 of 200 (1%, the most MAX_DROPPED_SHARE allows) need 5 turns: dropped, the other 198 kept in order
    c, logger = _components(arithmetic_suite, codec, n_detours=2), _Logger()
    demos = expert_demos(c, 200, seed=3, logger=logger)
    assert len(demos) == 198 and MAX_DROPPED_SHARE == 0.01
    assert [d.task.task_id for d in demos] == [t.task_id for t in arithmetic_suite.sample_tasks(200, split="train",
                                                                                              seed=3)[2:]]
    assert logger.records == [(0, "bc", {"data/demos": 200.0, "data/demos_dropped": 2.0})]
    assert len(logger.printed) == 1 and logger.printed[0].startswith("warning: dropped 2 of 200 expert demonstrations")
    assert "max_turns after 4 turns" in logger.printed[0] and "rollout.max_turns=4" in logger.printed[0]


def test_more_than_the_allowed_share_is_an_error(arithmetic_suite, codec):
    # 3 of 200 = 1.5% > 1%: the limits, not a tail, are wrong
    with pytest.raises(DemoLimitError, match=r"3 of 200 .*rollout.max_turns=4.*more than 1% may not be dropped"):
        expert_demos(_components(arithmetic_suite, codec, n_detours=3), 200, seed=3)
    # the share is a parameter of the check: 3 of 200 pass at 2%
    c = _components(arithmetic_suite, codec, n_detours=3)
    tasks = c.suite.sample_tasks(200, split="train", seed=3)
    env = c.suite.make_env()
    demos = [expert_trajectory(env, t, c.suite.expert_actions(t), codec, c.limits) for t in tasks]
    fit = check_demos_fit(demos, c.limits, max_dropped_share=0.02)
    assert (fit.total, fit.dropped, len(fit.kept)) == (200, 3, 197)


def test_demos_that_all_fit_log_zero_dropped_and_print_nothing(arithmetic_suite, codec):
    logger = _Logger()
    assert len(expert_demos(_components(arithmetic_suite, codec, n_detours=0, n=50), 50, seed=3, logger=logger)) == 50
    assert logger.records == [(0, "bc", {"data/demos": 50.0, "data/demos_dropped": 0.0})] and logger.printed == []
