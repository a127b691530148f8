"""Online RL step (GRPO by default): rollout groups -> score -> collate -> advantages -> clipped update.

Reads top to bottom like CleanRL's ppo.py; the math lives in `agentgrad.algos`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from agentgrad.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageParams
from agentgrad.algos.kl import kl_loss
from agentgrad.algos.losses import ppo_clip_loss
from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import token_logprobs
from agentgrad.batch import TokenBatch, collate
from agentgrad.data.replay import ReplayBuffer
from agentgrad.data.store import TrajectoryStore
from agentgrad.envs.base import Env
from agentgrad.envs.faults import FaultInjectingEnv
from agentgrad.faults import kill_point
from agentgrad.logging import RunLogger
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.faults import NonFiniteGuard, mask_tool_faults
from agentgrad.pipelines.replay import (add_fresh, build_replay, off_policy_correction, plan_step, sample_replay,
                                        update_success_ema)
from agentgrad.rewards.base import score
from agentgrad.rollout.loop import run_episodes
from agentgrad.types import ScoredTrajectory, Task, TrajectoryGroup


@dataclass
class RLState:
    """What an RL run carries from step to step; checkpointed whole so a resumed run continues exactly.
    Everything else a step samples depends only on (run seed, step)."""

    step: int = 0
    success_ema: float | None = None
    nonfinite: NonFiniteGuard = field(default_factory=lambda: NonFiniteGuard(3))
    replay: ReplayBuffer | None = None

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "success_ema": self.success_ema, "consecutive_nonfinite": self.nonfinite.consecutive}

    def restore(self, saved: dict[str, Any], replay: dict | None) -> None:
        self.step, self.success_ema = saved["step"], saved["success_ema"]
        self.nonfinite.consecutive = saved["consecutive_nonfinite"]
        if self.replay is not None and replay is not None:
            self.replay.load_state_dict(replay)


def initial_state(c: Components) -> RLState:
    return RLState(nonfinite=NonFiniteGuard(c.config.faults.max_consecutive_nonfinite), replay=build_replay(c.config))


def rl_tasks(c: Components, step: int) -> list[Task]:
    # A seed stream disjoint from the BC demos (seed + 1) and from evaluation (the held-out split).
    return c.suite.sample_tasks(c.config.algo.tasks_per_step, split="train",
                                seed=(c.config.run.seed + 1) * 1_000_003 + step)


def rollout_groups(c: Components, tasks: Sequence[Task], step: int) -> list[TrajectoryGroup]:
    G = c.config.algo.group_size
    repeated = [t for t in tasks for _ in range(G)]
    sampling = SamplingParams(max_new_tokens=c.limits.max_new_tokens_per_turn, temperature=c.config.rollout.temperature,
                              top_p=c.config.rollout.top_p, seed=c.config.run.seed * 7_919 + step)
    trajectories = run_episodes(c.policy, c.codec, [make_env(c, step, i) for i in range(len(repeated))], repeated,
                                sampling=sampling, limits=c.limits, sample_indices=[i % G for i in range(len(repeated))],
                                policy_version=step)
    scored = score(trajectories, c.reward_fn, c.suite)
    return [TrajectoryGroup(task, tuple(scored[i * G:(i + 1) * G])) for i, task in enumerate(tasks)]


def make_env(c: Components, step: int, index: int) -> Env:
    env = c.suite.make_env()
    rate = c.config.faults.inject_tool_failure_rate
    return FaultInjectingEnv(env, rate, seed=(c.config.run.seed * 1_009 + step) * 100_003 + index) if rate > 0 else env


def compute_advantages(c: Components, batch: TokenBatch) -> TokenBatch:
    algo = c.config.algo
    estimator = ADVANTAGE_ESTIMATORS.get(algo.name)
    out = estimator(batch.token_rewards, batch.loss_mask, batch.group_index, None,
                    AdvantageParams(norm_by_std=algo.norm_by_std))
    return batch.replace(advantages=out.advantages, returns=out.returns)


@torch.no_grad()
def reference_logprobs(reference: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    return token_logprobs(reference, batch.input_ids, batch.attention_mask, temperature)  # (B, T)


@torch.no_grad()
def proximal_logprobs(c: Components, batch: TokenBatch) -> torch.Tensor:
    """The current policy's logprobs of every token before this step's update, minibatch by minibatch."""
    size = c.config.algo.minibatch_size_episodes
    out = torch.zeros_like(batch.old_logprobs)  # (B, T)
    for start in range(0, batch.num_sequences, size):
        rows = torch.arange(start, min(start + size, batch.num_sequences))
        lp = c.learner.logprobs(batch.select(rows), temperature=c.config.rollout.temperature)  # (b, t)
        out[rows, :lp.shape[1]] = lp
    return out


def correct_replayed(c: Components, batch: TokenBatch, num_fresh: int) -> tuple[TokenBatch, dict[str, float]]:
    replayed = torch.arange(batch.num_sequences) >= num_fresh  # (B,) replayed rows come after the fresh ones
    return off_policy_correction(c.config, batch, proximal_logprobs(c, batch), replayed)


def policy_update(c: Components, batch: TokenBatch, guard: NonFiniteGuard | None = None,
                  step: int = 0) -> dict[str, float]:
    """`epochs_per_step` passes of clipped policy-gradient updates over minibatches of episodes."""
    algo, temperature = c.config.algo, c.config.rollout.temperature
    totals: Counter = Counter()
    n_updates = 0
    if not bool((batch.advantages * batch.loss_mask).any()):
        # Every group was zero-signal: a step would only replay Adam's momentum from earlier batches.
        return {"train/updates": 0.0, "train/no_signal_steps": 1.0}
    generator = torch.Generator().manual_seed(c.config.run.seed)
    for _ in range(algo.epochs_per_step):
        order = torch.randperm(batch.num_sequences, generator=generator)
        for start in range(0, batch.num_sequences, algo.minibatch_size_episodes):
            mb = batch.select(order[start:start + algo.minibatch_size_episodes])
            logprobs = c.learner.logprobs(mb, temperature=temperature)  # (b, T)
            pl = ppo_clip_loss(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, clip_low=algo.clip_low,
                               clip_high=algo.clip_high, agg=algo.loss_agg, is_weights=mb.is_weights)
            loss = pl.loss
            if mb.ref_logprobs is not None:
                kl = kl_loss(logprobs, mb.ref_logprobs, mb.loss_mask, kind=algo.kl_estimator, agg=algo.loss_agg)
                loss = loss + algo.kl_coef * kl
                totals["loss/kl"] += kl.item()
            if guard is not None and not guard.check(loss):
                c.learner.optimizer.zero_grad(set_to_none=True)  # skipped: parameters stay as they were
                totals["faults/nonfinite_losses"] += 1
                n_updates += 1
                continue
            totals.update(c.learner.step(loss))
            kill_point("update", step)
            totals.update({"loss/policy": pl.loss.item(), "loss/clipfrac": pl.clipfrac.item(),
                           "loss/approx_kl_old": pl.approx_kl.item()})
            n_updates += 1
    out = {k: v / n_updates for k, v in totals.items()}
    out["faults/nonfinite_losses"] = totals["faults/nonfinite_losses"]
    out["faults/nonfinite_grads"] = totals["train/skipped_steps"]
    return out | {"train/updates": float(n_updates), "train/no_signal_steps": 0.0}


def rollout_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    samples: list[ScoredTrajectory] = [s for g in groups for s in g.samples]
    n = len(samples)
    scored = [s.total_reward for s in samples if not s.reward.masked]
    stops = Counter(s.trajectory.stop_reason.value for s in samples)
    out = {
        "rollout/success_rate": sum(s.success for s in samples) / n,
        "rollout/reward_mean": sum(scored) / max(1, len(scored)),  # over unmasked samples only
        "rollout/zero_signal_groups": sum(g.is_zero_signal for g in groups) / len(groups),
        "rollout/masked_samples": float(sum(s.reward.masked for s in samples)),
        "rollout/invalid_calls_per_episode": sum(s.trajectory.num_invalid_calls for s in samples) / n,
        "rollout/turns_per_episode": sum(len(s.trajectory.turns) for s in samples) / n,
        "rollout/generated_tokens": float(sum(s.trajectory.num_generated_tokens for s in samples)),
    }
    out.update({f"rollout/stop_{reason}": count / n for reason, count in stops.items()})
    return out


def rl_step(c: Components, step: int, reference: torch.nn.Module | None, store: TrajectoryStore | None,
            state: RLState | None = None) -> dict[str, float]:
    state = state or RLState()
    t0 = time.perf_counter()
    num_fresh, num_replayed = plan_step(c.config, state.replay, state.success_ema or 0.0)
    fresh = rollout_groups(c, rl_tasks(c, step)[:num_fresh], step)
    fresh, fault_metrics = mask_tool_faults(fresh, enabled=c.config.faults.mask_tool_faults)
    kill_point("rollout", step)
    t_rollout = time.perf_counter() - t0
    groups = fresh + sample_replay(c.config, state.replay, num_replayed, step)
    samples = [s for g in groups for s in g.samples]
    batch = collate(samples, pad_token_id=c.pad_token_id,
                    group_index=[i for i, g in enumerate(groups) for _ in g.samples])
    batch = compute_advantages(c, batch)
    metrics: dict[str, float] = {}
    if num_replayed:
        batch, metrics = correct_replayed(c, batch, num_fresh=sum(len(g.samples) for g in fresh))
    if reference is not None:
        batch = batch.replace(ref_logprobs=reference_logprobs(reference, batch, c.config.rollout.temperature))
    metrics |= policy_update(c, batch, state.nonfinite, step)
    fresh_samples = [s for g in fresh for s in g.samples]
    if store is not None:
        store.append(fresh_samples, step=step, stage="rl",
                     groups=[f"{step}:{i}" for i, g in enumerate(fresh) for _ in g.samples])
    add_fresh(c.config, state.replay, fresh, step)
    metrics |= rollout_metrics(fresh) | fault_metrics
    state.success_ema = update_success_ema(c.config, state.success_ema, metrics["rollout/success_rate"])
    metrics |= {"replay/fresh_groups": float(num_fresh), "replay/replayed_groups": float(num_replayed),
                "replay/buffer_groups": float(len(state.replay) if state.replay is not None else 0)}
    elapsed = time.perf_counter() - t0
    metrics |= {"perf/step_s": elapsed, "perf/rollout_s": t_rollout,
                "perf/tokens_per_s": metrics["rollout/generated_tokens"] / max(t_rollout, 1e-9)}
    return metrics


def run_rl(c: Components, logger: RunLogger, store: TrajectoryStore | None = None, *, state: RLState | None = None,
           reference: torch.nn.Module | None = None, save: Callable[[RLState], None] | None = None) -> RLState:
    """Steps `state.step` .. algo.steps - 1. `save(state)` runs every run.checkpoint_every steps (after the
    step's records are stored), so a crash resumes from the last saved state. `reference` (a frozen copy of the
    policy at the start of RL) is built here unless a resumed run passes the one it loaded."""
    algo = c.config.algo
    state = state or initial_state(c)
    if algo.kl_coef > 0 and reference is None:
        import copy

        reference = copy.deepcopy(c.loaded.model).eval().requires_grad_(False)
    c.learner.set_lr(algo.lr)
    logger.display.start(algo.name, algo.steps)
    every = c.config.run.checkpoint_every
    while state.step < algo.steps:
        step = state.step
        metrics = rl_step(c, step, reference, store, state)
        state.step = step + 1
        if (step + 1) % c.config.run.log_every == 0 or step + 1 == algo.steps:
            logger.log(step + 1, algo.name, metrics)
        if save is not None and every and (step + 1) % every == 0:
            save(state)
    logger.display.stop()
    return state
