"""The reward scripts/gpu_check.sh trains on: the share of a trajectory's generated tokens with an even id. A
randomly initialised model earns it unevenly, so every GRPO group has signal and every step runs the learner's
update and weight sync (the check measures throughput; the outcome reward of an untrained model is 0 everywhere,
which would leave every step without an update)."""

from agentgrad.types import RewardBreakdown, Trajectory


def token_parity_reward(trajectory: Trajectory) -> RewardBreakdown:
    generated = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask) if m]
    return RewardBreakdown(sum(t % 2 == 0 for t in generated) / max(1, len(generated)),
                           (0.0,) * len(trajectory.turns))
