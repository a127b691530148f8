"""examples/custom_algorithm.py's estimator, worked by hand, and how a run finds it (algo.advantage_estimator)."""

import pytest
import torch

from agentgrad.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageParams
from agentgrad.pipelines.preflight import BadInputError, check_advantage_estimator
from examples.custom_algorithm import digits_right, median_baseline


def test_median_baseline_by_hand():
    # 3 groups of 4 one-turn episodes; outcome reward on each row's last policy token (column 2).
    scores = [[1, 0, 0, 0],   # lower median of (0, 0, 0, 1) = 0: only the success moves, +1
              [1, 1, 1, 0],   # median 1: only the failure moves, -1
              [1, 1, 0, 0]]   # even count, torch takes the lower middle value, 0: the two successes get +1
    rewards = torch.zeros(12, 4)  # (B, T)
    rewards[:, 2] = torch.tensor(scores, dtype=torch.float).flatten()
    mask = torch.tensor([[0, 1, 1, 0]] * 12, dtype=torch.float)  # (B, T): tokens 1-2 are the policy's
    groups = torch.arange(3).repeat_interleave(4)  # (B,)
    out = median_baseline(rewards, mask, groups, None, AdvantageParams())
    expected = [1, 0, 0, 0, 0, 0, 0, -1, 1, 1, 0, 0]
    assert out.advantages[:, 1].tolist() == expected and out.advantages[:, 2].tolist() == expected
    assert out.advantages[:, [0, 3]].abs().sum() == 0  # nothing off the policy tokens
    assert out.returns[:, 1].tolist() == rewards[:, 2].tolist()  # one turn, gamma 1: the return is the outcome


def test_a_lone_row_and_an_empty_row_get_no_advantage():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0]])  # (B, T)
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])  # row 2 has no policy tokens (a masked sample)
    out = median_baseline(rewards, mask, torch.tensor([0, 1, 1]), None, AdvantageParams())
    assert out.advantages.abs().sum() == 0  # row 0: alone in its group; row 1: only valid row of group 1


def test_digits_right_gives_partial_credit():
    assert digits_right("3412", "3412") == 1.0
    assert digits_right("3402", "3412") == 0.75
    assert digits_right("341", "3412") == 0.75 and digits_right("34120", "3412") == 0.8
    assert digits_right(None, "3412") == 0.0


def test_a_run_names_the_estimator_by_import_path_or_is_told_what_exists():
    check_advantage_estimator("examples.custom_algorithm:median_baseline")  # resolves: no error
    assert ADVANTAGE_ESTIMATORS.get("examples.custom_algorithm:median_baseline") is median_baseline
    with pytest.raises(BadInputError, match=r"algo.advantage_estimator: unknown advantage estimator 'median'.*grpo"):
        check_advantage_estimator("median")
    with pytest.raises(BadInputError, match="algo.advantage_estimator"):
        check_advantage_estimator("examples.custom_algorithm:no_such_function")
