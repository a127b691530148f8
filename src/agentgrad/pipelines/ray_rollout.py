"""Ray rollout workers (`rollout.backend=ray`): actors that each hold a policy replica and run envs and episodes;
a driver that spreads a step's groups over them, broadcasts versioned weights, and re-issues a dead worker's
episodes.

- Each worker loads the model directory the run loaded (its config and tokenizer; on a cluster every node must
  read that path) and then takes its weights from the driver: `sync_weights` puts the learner's state in Ray's
  object store once per policy version and every worker loads it before it samples again. A trajectory carries
  the version its worker held (`Trajectory.policy_version`); the driver checks it is the one asked for.
- A step's episodes keep their index in the step: worker-side they decode under that key
  (`backends/keyed.py`) and get that index's env, so with `rollout.batch_invariant` (floats independent of which
  episodes share a decode step) the trajectories are those of the in-process runner, token for token.
- A group's episodes go to one worker (they share a prompt, which the worker's engine encodes once); groups go
  round robin. A worker's shard comes back whole or not at all: when its actor dies (ray.kill, a crash, a lost
  node) the driver starts a fresh actor in its slot, gives it the current weights, and re-issues the whole shard.
  The re-issued episodes are the same episodes (same index, same seed); the dead worker's partial episodes never
  reached the driver, so nothing is lost and nothing is stored twice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.keyed import KeyedSessionPolicy
from agentgrad.config import Config
from agentgrad.envs.base import close_envs
from agentgrad.pipelines.preflight import BadInputError
from agentgrad.types import Task, Trajectory

MAX_ATTEMPTS = 3
"""A shard whose worker died this many times in one step stops the run (a crash that follows the episodes)."""


@dataclass(frozen=True)
class Shard:
    """Episodes of one step for one worker: their indices in the step, tasks and sample indices."""

    indices: tuple[int, ...]
    tasks: tuple[Task, ...]
    sample_indices: tuple[int, ...]
    sampling: SamplingParams
    step: int
    policy_version: int


class RolloutWorker:
    """A Ray actor (wrapped by `ray.remote` in `RayRollout`): a policy replica, the suite's envs, the scheduler."""

    def __init__(self, config: dict[str, Any], model_dir: str) -> None:
        from agentgrad.models.hf import load_model
        from agentgrad.pipelines.components import episode_limits, inference, make_suite, quiet_hf, sampler_settings

        quiet_hf()
        self.config = Config.model_validate(config)
        torch.set_num_threads(self.config.run.threads)
        self.suite = make_suite(self.config)
        loaded = load_model(model_dir, dtype=self.config.model.dtype, device=self.config.model.device)
        self.policy, self.codec = inference(loaded, self.config.model, self.config.rollout)
        self.limits, self.sampler = episode_limits(self.config), sampler_settings(self.config)
        self.version: int | None = None

    def set_weights(self, version: int, state: Mapping[str, torch.Tensor]) -> int:
        self.policy.load_weights(state)
        self.version = version
        return os.getpid()

    def run(self, shard: Shard) -> list[tuple[int, Trajectory]]:
        from agentgrad.pipelines.rollout_backend import make_rollout_env
        from agentgrad.rollout.loop import run_episodes

        if self.version != shard.policy_version:
            raise RuntimeError(f"worker holds policy version {self.version}, shard wants {shard.policy_version}")
        envs = [make_rollout_env(self.config, self.suite, shard.step, i) for i in shard.indices]
        try:
            trajectories = run_episodes(KeyedSessionPolicy(self.policy, shard.indices), self.codec, envs,
                                        list(shard.tasks), sampling=shard.sampling, limits=self.limits,
                                        sampler=self.sampler, sample_indices=list(shard.sample_indices),
                                        policy_version=self.version)
        finally:
            close_envs(envs)
        return list(zip(shard.indices, trajectories))

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        from agentgrad.envs import close_suite

        close_suite(self.suite)


def spread(num_episodes: int, group_size: int, num_workers: int) -> list[list[int]]:
    """Episode indices per worker: whole groups (`group_size` consecutive episodes), round robin."""
    shards: list[list[int]] = [[] for _ in range(num_workers)]
    for g, start in enumerate(range(0, num_episodes, group_size)):
        shards[g % num_workers].extend(range(start, min(start + group_size, num_episodes)))
    return shards


class RayRollout:
    """The driver: `rollout.workers` actors on the Ray runtime this process joins (or starts)."""

    def __init__(self, config: Config, model_dir: str | None) -> None:
        import ray

        r = config.rollout
        if r.action_head != "tokens":
            raise ValueError("rollout.backend=ray runs token action heads only (rollout.action_head=tokens)")
        if model_dir is None:
            raise ValueError("rollout.backend=ray needs the model directory the run loaded")
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            ray.init(address=r.ray_address, include_dashboard=False, log_to_driver=False)
        offered = ray.cluster_resources().get("CPU", 0.0)
        if r.workers * r.worker_cpus > offered:  # Ray would leave the surplus workers pending, silently, for ever
            if self.owns_ray:
                ray.shutdown()
            raise BadInputError(f"rollout.workers={r.workers} x rollout.worker_cpus={r.worker_cpus:g} needs "
                                f"{r.workers * r.worker_cpus:g} CPUs; the Ray runtime offers {offered:g}: lower "
                                "them (worker_cpus may be fractional) or add nodes")
        self.config_dict, self.model_dir = config.to_dict(), model_dir
        self.actor = ray.remote(num_cpus=r.worker_cpus, max_restarts=0)(RolloutWorker)
        self.version: int | None = None
        self.weights: Any = None  # ObjectRef of the version's state dict
        self.workers = [self._spawn() for _ in range(r.workers)]
        self.reissued = 0  # episodes re-run because their worker died (over the driver's life)
        self.respawned = 0  # workers started in a dead one's slot
        self.syncs = 0  # weight broadcasts

    def _spawn(self) -> Any:
        worker = self.actor.remote(self.config_dict, self.model_dir)
        if self.weights is not None:
            worker.set_weights.remote(self.version, self.weights)  # ordered before any run on this actor
        return worker

    def sync_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Broadcast `weights` (a state dict) as `version` if the workers hold another version."""
        import ray

        if version == self.version:
            return
        state = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
        self.version, self.weights = version, ray.put(state)
        from ray.exceptions import RayActorError, WorkerCrashedError

        acks = [w.set_weights.remote(version, self.weights) for w in self.workers]
        for slot, ack in enumerate(acks):
            try:
                ray.get(ack)
            except (RayActorError, WorkerCrashedError):  # died since its last shard: a fresh one gets these weights
                self.workers[slot] = self._spawn()
                self.respawned += 1
        self.syncs += 1

    def metrics(self) -> dict[str, float]:
        """Counters over the run so far (the dashboards' ray/* keys)."""
        return {"ray/workers": float(len(self.workers)), "ray/weight_syncs": float(self.syncs),
                "ray/reissued_episodes": float(self.reissued), "ray/respawned_workers": float(self.respawned)}

    def shards(self, tasks: Sequence[Task], group_size: int, sampling: SamplingParams, step: int) -> list[Shard]:
        """The step's episodes (groups of `group_size` consecutive ones) as one shard per worker that has any."""
        out = []
        for idx in spread(len(tasks), group_size, len(self.workers)):
            if idx:
                out.append(Shard(tuple(idx), tuple(tasks[i] for i in idx), tuple(i % group_size for i in idx),
                                 sampling, step, self._version()))
        return out

    def _version(self) -> int:
        if self.version is None:
            raise RuntimeError("sync_weights before the first rollout")
        return self.version

    def submit(self, shards: Sequence[Shard]) -> dict[Any, tuple[int, Any, Shard, int]]:
        """Start the shards, shard k on worker k; returns the pending calls (ref -> (slot, actor, shard, try))."""
        return {self.workers[k].run.remote(s): (k, self.workers[k], s, 1) for k, s in enumerate(shards)}

    def gather(self, pending: dict[Any, tuple[int, Any, Shard, int]]) -> dict[int, Trajectory]:
        """Wait for every shard; a shard whose worker died is re-issued to a fresh worker in its slot."""
        import ray
        from ray.exceptions import RayActorError, WorkerCrashedError

        out: dict[int, Trajectory] = {}
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            slot, actor, shard, attempt = pending.pop(ref)
            try:
                results = ray.get(ref)
            except (RayActorError, WorkerCrashedError):
                if attempt >= MAX_ATTEMPTS:
                    raise RuntimeError(f"rollout worker died {attempt} times on episodes {shard.indices[:8]}...; "
                                       "giving up") from None
                if self.workers[slot] is actor:  # the first of its shards to report the death replaces it
                    self.workers[slot] = self._spawn()
                    self.respawned += 1
                self.reissued += len(shard.indices)
                pending[self.workers[slot].run.remote(shard)] = (slot, self.workers[slot], shard, attempt + 1)
                continue
            for index, trajectory in results:
                if index in out:
                    raise RuntimeError(f"episode {index} came back twice")
                if trajectory.policy_version != shard.policy_version:
                    raise RuntimeError(f"episode {index} sampled with policy version {trajectory.policy_version}, "
                                       f"not {shard.policy_version}")
                out[index] = trajectory
        return out

    def run(self, tasks: Sequence[Task], group_size: int, *, sampling: SamplingParams, step: int
            ) -> list[Trajectory]:
        """One episode per task over the workers, in input order."""
        results = self.gather(self.submit(self.shards(tasks, group_size, sampling, step)))
        missing = [i for i in range(len(tasks)) if i not in results]
        if missing:
            raise RuntimeError(f"episodes {missing[:8]} never came back")
        return [results[i] for i in range(len(tasks))]

    def close(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self.owns_ray:
            ray.shutdown()
