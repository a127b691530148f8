"""Importable by the `agentgrad train` subprocesses of test_kill_resume.py (on their PYTHONPATH)."""

from agentgrad.envs.tasks.arithmetic import ArithmeticSuite
from agentgrad.types import RewardBreakdown, Task, Trajectory


def token_parity_reward(trajectory: Trajectory) -> RewardBreakdown:
    """A reward an untrained model earns unevenly (so every GRPO group has signal and every step updates):
    the share of its generated tokens with an even id."""
    gen = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask) if m]
    return RewardBreakdown(sum(t % 2 == 0 for t in gen) / max(1, len(gen)), (0.0,) * len(trajectory.turns))


class EvenAnswerArithmetic(ArithmeticSuite):
    """Arithmetic whose verifier accepts any answer of even length: an untrained model that ends a turn (EOS)
    gives an answer of some length, so it succeeds now and then and DPO finds (success, failure) pairs."""

    name = "even-answer-arithmetic"

    def verify(self, task: Task, answer: str | None) -> bool:
        return answer is not None and len(answer) % 2 == 0
