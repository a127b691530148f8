"""rollout.backend=vllm: RL rollouts sampled by a vLLM engine in this process (`backends/vllm_policy.py`) or by vLLM's
OpenAI-compatible server (`backends/vllm_server.py`, rollout.vllm_server), through
the same scheduler and codec as the local backend; the learner's weights go into the engine whenever the policy
version changes (and once at the start: the engine loads the model directory, the run may have trained since)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.vllm_policy import VLLMPolicy
from agentgrad.backends.vllm_server import VLLMServerPolicy, start_server
from agentgrad.config import Config
from agentgrad.envs.base import TaskSuite, close_envs
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.loop import EpisodeLimits, SamplerSettings, run_episodes
from agentgrad.types import Task, Trajectory


class VLLMRollout:
    """The engine, the weights' version it holds, and counters for the dashboards (vllm/* keys)."""

    def __init__(self, config: Config, model_dir: str, eos_token_ids: Sequence[int], log_dir: str | Path) -> None:
        """`log_dir`: where a server the run starts writes its log (vllm-server.log)."""
        started = time.monotonic()
        self.config = config
        r = config.rollout
        self.policy: VLLMPolicy | VLLMServerPolicy
        if r.vllm_server is None:
            self.policy = VLLMPolicy(model_dir, eos_token_ids=eos_token_ids, seed=config.run.seed,
                                     kv_cache_mb=r.vllm_kv_cache_mb, max_model_len=r.max_total_tokens)
        elif r.vllm_server == "start":
            process, url = start_server(model_dir, seed=config.run.seed, kv_cache_mb=r.vllm_kv_cache_mb,
                                        max_model_len=r.max_total_tokens, log_path=Path(log_dir) / "vllm-server.log")
            self.policy = VLLMServerPolicy(url, eos_token_ids=eos_token_ids, process=process,
                                           max_concurrent_requests=r.max_concurrent_episodes)
        else:
            self.policy = VLLMServerPolicy(r.vllm_server, eos_token_ids=eos_token_ids,
                                           max_concurrent_requests=r.max_concurrent_episodes)
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
