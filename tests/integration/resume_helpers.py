"""Importable by the `agentgrad train` subprocesses of test_kill_resume.py (on their PYTHONPATH)."""

from agentgrad.types import RewardBreakdown, Trajectory


def token_parity_reward(trajectory: Trajectory) -> RewardBreakdown:
    """A reward an untrained model earns unevenly (so every GRPO group has signal and every step updates):
    the share of its generated tokens with an even id."""
    gen = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask) if m]
    return RewardBreakdown(sum(t % 2 == 0 for t in gen) / max(1, len(gen)), (0.0,) * len(trajectory.turns))
