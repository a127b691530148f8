"""Expert guidance in RL groups (`algo.expert_samples`, pipelines/guidance.py) on real rollouts of the untrained
tiny model, which fails every arithmetic task: without guidance no group has signal and filtering keeps none;
with one expert episode per group every group has signal, the expert's behaviour logprobs are the learner's own,
and the rollout's sampled groups (metrics, store) hold the policy's samples only."""

from __future__ import annotations

import pytest
import torch
from test_train_tiny import FAST

from agentgrad.config import build_config
from agentgrad.pipelines import rl
from agentgrad.pipelines.components import build_components


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    config = build_config(overrides=[*FAST, "algo.tasks_per_step=3", "algo.group_size=2", "algo.zero_signal=filter",
                                     "algo.expert_samples=1"])
    return build_components(config, tmp_path_factory.mktemp("guidance"))


def test_expert_gives_failed_groups_signal(untrained):
    c = untrained
    rollout = rl.collect_groups(c, step=0)
    assert len(rollout.sampled) == 3 and all(len(g.samples) == 2 for g in rollout.sampled)
    assert not any(s.success for g in rollout.sampled for s in g.samples)  # an untrained policy solves nothing
    assert all(g.is_zero_signal for g in rollout.sampled)
    assert len(rollout.groups) == 3  # filtering keeps every group: each has its expert
    for group in rollout.groups:
        *policy, expert = group.samples
        assert len(policy) == 2 and expert.success and not any(s.success for s in policy)
        assert expert.trajectory.task == group.task
    # the metrics see what the policy sampled
    assert rl.rollout_metrics(rollout.sampled)["rollout/success_rate"] == 0.0


def test_expert_logprobs_are_the_learners_so_its_ratio_starts_at_one(untrained):
    c = untrained
    rollout = rl.collect_groups(c, step=1)
    experts = [g.samples[-1] for g in rollout.groups]
    batch = c.collate(experts, group_index=list(range(len(experts))))
    with torch.no_grad():
        lp = c.learner.logprobs(batch, temperature=c.config.rollout.temperature)  # (B, T)
    mask = batch.loss_mask.bool()  # (B, T)
    assert mask.sum() > 0
    assert torch.all(batch.old_logprobs[mask] < 0)  # scored, not the zeros a demonstration carries
    assert torch.allclose(batch.old_logprobs[mask], lp[mask], atol=1e-5)
    assert torch.all(batch.old_logprobs[~mask] == 0)


def test_without_guidance_filtering_leaves_nothing(untrained):
    c = untrained
    plain = build_config(overrides=[*FAST, "algo.tasks_per_step=3", "algo.group_size=2", "algo.zero_signal=filter"])
    c.config, saved = plain, c.config
    try:
        rollout = rl.collect_groups(c, step=0)
    finally:
        c.config = saved
    assert len(rollout.sampled) == 3 and rollout.groups == ()
