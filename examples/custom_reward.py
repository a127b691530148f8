"""A user-defined reward: any callable Trajectory -> RewardBreakdown (or a plain float outcome).

Use it from the command line without touching agentgrad, from the repository root (the current directory is
importable, as under `python -m`); docs/your-own-reward.md:
    agentgrad check reward.name=examples.custom_reward:short_and_right
    agentgrad train reward.name=examples.custom_reward:short_and_right
"""

from agentgrad.types import RewardBreakdown, Trajectory


def short_and_right(suite, penalty_per_turn: float = 0.05):
    """A factory (it takes the suite): full credit for a verified answer, minus a little per extra turn."""

    def reward(trajectory: Trajectory) -> RewardBreakdown:
        correct = suite.verify(trajectory.task, trajectory.final_answer)
        extra_turns = max(0, len(trajectory.turns) - 2)
        return RewardBreakdown(outcome=(1.0 if correct else 0.0) - penalty_per_turn * extra_turns,
                               process=(0.0,) * len(trajectory.turns))

    return reward
