"""A user-defined reward: any callable Trajectory -> RewardBreakdown (or a plain float outcome).

Use it from the command line without touching agentgrad, from the repository root (the current directory is
importable, as under `python -m`); docs/your-own-reward.md:
    agentgrad check reward.name=examples.custom_reward:short_and_right
    agentgrad train reward.name=examples.custom_reward:short_and_right

`python examples/custom_reward.py` scores three arithmetic episodes with it: the expert's, one with an extra
tool call, one with a wrong answer.
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


class _Scripted:
    """The arithmetic suite with its expert replaced by a script of actions (to make episodes to score)."""

    def __init__(self, suite, actions):
        self.suite, self.actions = suite, actions

    def __getattr__(self, name):
        return getattr(self.suite, name)

    def expert_actions(self, task):
        return self.actions


if __name__ == "__main__":
    from agentgrad.envs import make_suite
    from agentgrad.envs.base import expert_episode
    from agentgrad.rewards.base import apply_reward
    from agentgrad.types import FinalAnswer

    suite = make_suite("arithmetic")
    task = suite.sample_tasks(1, split="train", seed=0)[0]
    reward_fn = short_and_right(suite)
    call, answer = suite.expert_actions(task)
    episodes = {"expert (call, answer)": expert_episode(suite, task),
                "extra call (call, call, answer)": expert_episode(_Scripted(suite, [call, call, answer]), task),
                "wrong answer (call, answer + 1)": expert_episode(
                    _Scripted(suite, [call, FinalAnswer(str(int(answer.text) + 1))]), task)}
    print(f"task: {task.prompt} (answer {task.answer})")
    for name, episode in episodes.items():
        print(f"{name}: {len(episode.turns)} turns, reward {apply_reward(reward_fn, episode).total:.2f}")
