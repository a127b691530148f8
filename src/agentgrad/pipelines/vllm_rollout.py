"""rollout.backend=vllm: RL rollouts sampled by a vLLM engine in this process (`backends/vllm_policy.py`), through
the same scheduler and codec as the local backend; the learner's weights go into the engine whenever the policy
version changes (and once at the start: the engine loads the model directory, the run may have trained since)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.vllm_policy import VLLMPolicy
from agentgrad.config import Config
from agentgrad.envs.base import TaskSuite, close_envs
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.loop import EpisodeLimits, SamplerSettings, run_episodes
from agentgrad.types import Task, Trajectory


class VLLMRollout:
    """The engine, the weights' version it holds, and counters for the dashboards (vllm/* keys)."""

    def __init__(self, config: Config, model_dir: str, eos_token_ids: Sequence[int]) -> None:
        started = time.monotonic()
        self.config = config
        self.policy = VLLMPolicy(model_dir, eos_token_ids=eos_token_ids, seed=config.run.seed,
                                 kv_cache_mb=config.rollout.vllm_kv_cache_mb,
                                 max_model_len=config.rollout.max_total_tokens)
        self.start_seconds = time.monotonic() - started
        self.version: int | None = None
        self.syncs = 0
        self.sync_seconds = 0.0

    def sync_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        if version == self.version:
            return
        started = time.monotonic()
        self.policy.load_weights(weights)
        self.version, self.syncs = version, self.syncs + 1
        self.sync_seconds += time.monotonic() - started

    def run(self, codec: ChatCodec, suite: TaskSuite, tasks: Sequence[Task], group_size: int, *,
            sampling: SamplingParams, step: int, limits: EpisodeLimits, sampler: SamplerSettings) -> list[Trajectory]:
        from agentgrad.pipelines.rollout_backend import make_rollout_env

        envs = [make_rollout_env(self.config, suite, step, i) for i in range(len(tasks))]
        try:
            return run_episodes(self.policy, codec, envs, tasks, sampling=sampling, limits=limits, sampler=sampler,
                                sample_indices=[i % group_size for i in range(len(tasks))],
                                policy_version=self.version or 0)
        finally:
            close_envs(envs)

    def metrics(self) -> dict[str, float]:
        return {"vllm/weight_syncs": float(self.syncs), "vllm/sync_seconds": self.sync_seconds,
                "vllm/engine_start_seconds": self.start_seconds}

    def close(self) -> None:
        self.policy.close()
