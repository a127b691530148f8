"""Where an RL step's episodes run (`rollout.backend`): in this process, spread over Ray rollout workers
(`pipelines/ray_rollout.py`, imported only when chosen; both give the same trajectories for the same seeds), or
on a vLLM engine in this process (`pipelines/vllm_rollout.py`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import HFPolicy
from agentgrad.config import Config
from agentgrad.envs.base import Env, TaskSuite, close_envs
from agentgrad.envs.faults import FaultInjectingEnv
from agentgrad.pipelines.components import Components, sampling_policy
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.loop import run_episodes
from agentgrad.types import Task, Trajectory


def make_rollout_env(config: Config, suite: TaskSuite, step: int, index: int) -> Env:
    """Episode `index` of step `step`'s env (with its own fault-injection seed when faults are injected)."""
    env = suite.make_env()
    rate = config.faults.inject_tool_failure_rate
    return FaultInjectingEnv(env, rate, seed=(config.run.seed * 1_009 + step) * 100_003 + index) if rate > 0 else env


def run_rollout(c: Components, tasks: Sequence[Task], group_size: int, *, sampling: SamplingParams, step: int,
                policy_version: int, weights: Mapping[str, torch.Tensor] | None = None) -> list[Trajectory]:
    """One episode per task (episode i keyed i: its env, its randomness; sample i % group_size of its group), in
    input order, with the configured backend. `weights` (a snapshot, for async rollouts) are sampled from instead of
    the live policy: on a copy of the model in process, or broadcast to the Ray workers, which also get the
    learner's weights whenever `policy_version` changed."""
    sample_indices = [i % group_size for i in range(len(tasks))]
    if c.config.rollout.backend == "ray":
        if c.rollout_runner is None:
            from agentgrad.pipelines.ray_rollout import RayRollout

            c.rollout_runner = RayRollout(c.config, c.model_dir)
        c.rollout_runner.sync_weights(policy_version, c.loaded.model.state_dict() if weights is None else weights)
        return c.rollout_runner.run(tasks, group_size, sampling=sampling, step=step)
    if c.config.rollout.backend == "vllm":
        if c.rollout_runner is None:
            from agentgrad.pipelines.vllm_rollout import VLLMRollout

            c.rollout_runner = VLLMRollout(c.config, c.model_dir, c.loaded.eos_token_ids, c.run_dir or ".")
        c.rollout_runner.sync_weights(policy_version, c.loaded.model.state_dict() if weights is None else weights)
        return c.rollout_runner.run(c.codec, c.suite, tasks, group_size, sampling=sampling, step=step,
                                    limits=c.limits, sampler=c.sampler)
    policy, codec = c.policy, c.codec
    if weights is not None:
        policy, codec = sampling_replica(c)
        policy.load_weights(weights)
    envs = [make_rollout_env(c.config, c.suite, step, i) for i in range(len(tasks))]
    try:
        return run_episodes(policy, codec, envs, tasks, sampling=sampling, limits=c.limits, sampler=c.sampler,
                            sample_indices=sample_indices, policy_version=policy_version)
    finally:
        close_envs(envs)


def sampling_replica(c: Components) -> tuple[HFPolicy, ChatCodec]:
    """A policy on its own copy of the model, and a codec on its own tokenizer: async rollouts sample on them on a
    background thread while the learner updates the live model (tokenizers are not safe to share across threads)."""
    if c.sampling_replica is None:
        model = copy.deepcopy(c.loaded.model).eval().requires_grad_(False)
        policy = sampling_policy(c.loaded, model, c.config.rollout)
        c.sampling_replica = (policy, copy.deepcopy(c.codec))
    return c.sampling_replica


def close_rollout(c: Components) -> None:
    """Stop the Ray workers (and the Ray runtime the run started) or the vLLM engine, if any."""
    if c.rollout_runner is not None:
        c.rollout_runner.close()
        c.rollout_runner = None
