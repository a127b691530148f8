"""BC refuses expert demonstrations that the rollout limits cut short, and says which limit to raise."""

import pytest

from agentgrad.pipelines.bc import DemoLimitError, check_demos_fit
from agentgrad.rollout.loop import RolloutLimits, expert_trajectory


def test_demos_that_do_not_fit_the_limits_fail_fast(arithmetic_suite, codec):
    task = arithmetic_suite.sample_tasks(1, split="train", seed=0)[0]
    actions = arithmetic_suite.expert_actions(task)
    env = arithmetic_suite.make_env()
    check_demos_fit([expert_trajectory(env, task, actions, codec, RolloutLimits())], RolloutLimits())

    cut = expert_trajectory(env, task, actions, codec, RolloutLimits(max_turns=1))
    with pytest.raises(DemoLimitError, match="rollout.max_turns=1"):
        check_demos_fit([cut], RolloutLimits(max_turns=1))
    tight = RolloutLimits(max_new_tokens_per_turn=4)
    with pytest.raises(DemoLimitError, match="rollout.max_new_tokens_per_turn=4"):
        check_demos_fit([expert_trajectory(env, task, actions, codec, tight)], tight)
