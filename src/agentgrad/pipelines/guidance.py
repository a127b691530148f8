"""Expert guidance inside RL groups: each fresh group also holds the suite's expert episode for its task.

A group the policy fails in every sample has no signal, and dropping it (`algo.zero_signal=filter`) leaves the
policy where it is on exactly the tasks it cannot yet do. Off-policy guidance (LUFFY, Yan et al. 2025) puts an
expert solution into the group instead: the group-relative advantage then raises the expert's tokens and lowers
the failed samples', so the hardest tasks teach most; on tasks the policy already solves, the expert changes
little (an all-solved group stays without signal).

The expert episode is encoded through the rollout's own path (`expert_trajectory`, as BC's demonstrations are)
and its behaviour logprobs are the policy's own as the step samples (the learner's scoring path, at the rollout
temperature), so its importance ratio starts at 1 and PPO's clip bounds how far one step moves it, as for any
sample. It carries
no token masks: it is scored unmasked on both sides of the ratio. It joins the groups the step trains on, never
the sampled ones: rollout metrics and the trajectory store see the policy's samples only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from agentgrad.backends.scoring import Scoring
from agentgrad.envs.base import close_env
from agentgrad.pipelines.demos import FINISHED
from agentgrad.rewards.base import score
from agentgrad.rollout.loop import expert_trajectory
from agentgrad.types import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from agentgrad.pipelines.components import Components


def with_expert_samples(c: Components, groups: Sequence[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """`groups`, each with `algo.expert_samples` copies of its task's expert episode added (none when 0, or when
    the expert's episode does not fit the rollout limits)."""
    k = c.config.algo.expert_samples
    if k == 0 or not groups:
        return list(groups)
    env = c.suite.make_env()
    try:
        experts = [expert_trajectory(env, g.task, c.suite.expert_actions(g.task), c.codec, c.limits) for g in groups]
    finally:
        close_env(env)
    scored = score(policy_scored(c, experts), c.reward_fn, c.suite)
    fits = [e.trajectory.stop_reason in FINISHED for e in scored]  # as BC's demonstrations must
    return [TrajectoryGroup(g.task, (*g.samples, *([e] * k if fit else []))) for g, e, fit in zip(groups, scored, fits)]


@torch.no_grad()
def policy_scored(c: Components, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """`trajectories` with the current policy's logprobs (at the rollout temperature) on their policy tokens, as
    the learner scores a batch: their behaviour logprobs, as if the policy had sampled them now."""
    batch = c.collate(list(trajectories), group_index=list(range(len(trajectories))))
    lp = Scoring(c.config.rollout.temperature).policy(c.learner, batch).tolist()  # (B, T)
    return [dataclasses.replace(t, logprobs=tuple(lp[b][i] if m else 0.0 for i, m in enumerate(t.loss_mask)))
            for b, t in enumerate(trajectories)]
