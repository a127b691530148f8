"""Online RL step (GRPO by default): rollout groups -> score -> collate -> advantages -> clipped update.

Reads top to bottom like CleanRL's ppo.py; the math lives in `agentgrad.algos`.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Sequence

import torch

from agentgrad.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageParams
from agentgrad.algos.kl import kl_loss
from agentgrad.algos.losses import ppo_clip_loss
from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import token_logprobs
from agentgrad.batch import TokenBatch, collate
from agentgrad.data.store import TrajectoryStore
from agentgrad.logging import RunLogger
from agentgrad.pipelines.components import Components
from agentgrad.rewards.base import score
from agentgrad.rollout.loop import run_episodes
from agentgrad.types import ScoredTrajectory, Task, TrajectoryGroup


def rl_tasks(c: Components, step: int) -> list[Task]:
    # A seed stream disjoint from the BC demos (seed + 1) and from evaluation (the held-out split).
    return c.suite.sample_tasks(c.config.algo.tasks_per_step, split="train",
                                seed=(c.config.run.seed + 1) * 1_000_003 + step)


def rollout_groups(c: Components, tasks: Sequence[Task], step: int) -> list[TrajectoryGroup]:
    G = c.config.algo.group_size
    repeated = [t for t in tasks for _ in range(G)]
    sampling = SamplingParams(max_new_tokens=c.limits.max_new_tokens_per_turn, temperature=c.config.rollout.temperature,
                              top_p=c.config.rollout.top_p, seed=c.config.run.seed * 7_919 + step)
    trajectories = run_episodes(c.policy, c.codec, [c.suite.make_env() for _ in repeated], repeated,
                                sampling=sampling, limits=c.limits, sample_indices=[i % G for i in range(len(repeated))],
                                policy_version=step)
    scored = score(trajectories, c.reward_fn, c.suite)
    return [TrajectoryGroup(task, tuple(scored[i * G:(i + 1) * G])) for i, task in enumerate(tasks)]


def compute_advantages(c: Components, batch: TokenBatch) -> TokenBatch:
    algo = c.config.algo
    estimator = ADVANTAGE_ESTIMATORS.get(algo.name)
    out = estimator(batch.token_rewards, batch.loss_mask, batch.group_index, None,
                    AdvantageParams(norm_by_std=algo.norm_by_std))
    return batch.replace(advantages=out.advantages, returns=out.returns)


@torch.no_grad()
def reference_logprobs(reference: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    return token_logprobs(reference, batch.input_ids, batch.attention_mask, temperature, batch.logit_masks)  # (B, T)


def policy_update(c: Components, batch: TokenBatch) -> dict[str, float]:
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
                               clip_high=algo.clip_high, agg=algo.loss_agg)
            loss = pl.loss
            if mb.ref_logprobs is not None:
                kl = kl_loss(logprobs, mb.ref_logprobs, mb.loss_mask, kind=algo.kl_estimator, agg=algo.loss_agg)
                loss = loss + algo.kl_coef * kl
                totals["loss/kl"] += kl.item()
            totals.update(c.learner.step(loss))
            totals.update({"loss/policy": pl.loss.item(), "loss/clipfrac": pl.clipfrac.item(),
                           "loss/approx_kl_old": pl.approx_kl.item()})
            n_updates += 1
    return {k: v / n_updates for k, v in totals.items()} | {"train/updates": float(n_updates),
                                                           "train/no_signal_steps": 0.0}


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


def rl_step(c: Components, step: int, reference: torch.nn.Module | None, store: TrajectoryStore | None) -> dict[str, float]:
    t0 = time.perf_counter()
    tasks = rl_tasks(c, step)
    groups = rollout_groups(c, tasks, step)
    samples = [s for g in groups for s in g.samples]
    t_rollout = time.perf_counter() - t0
    batch = collate(samples, pad_token_id=c.pad_token_id,
                    group_index=[i for i, g in enumerate(groups) for _ in g.samples])
    batch = compute_advantages(c, batch)
    if reference is not None:
        batch = batch.replace(ref_logprobs=reference_logprobs(reference, batch, c.config.rollout.temperature))
    metrics = policy_update(c, batch)
    if store is not None:
        store.append(samples, step=step, stage="rl")
    metrics |= rollout_metrics(groups)
    elapsed = time.perf_counter() - t0
    metrics |= {"perf/step_s": elapsed, "perf/rollout_s": t_rollout,
                "perf/tokens_per_s": metrics["rollout/generated_tokens"] / max(t_rollout, 1e-9)}
    return metrics


def run_rl(c: Components, logger: RunLogger, store: TrajectoryStore | None = None) -> None:
    algo = c.config.algo
    if algo.steps == 0:
        return
    reference = None
    if algo.kl_coef > 0:
        import copy

        reference = copy.deepcopy(c.loaded.model).eval().requires_grad_(False)
    c.learner.set_lr(algo.lr)
    logger.display.start(algo.name, algo.steps)
    for step in range(algo.steps):
        metrics = rl_step(c, step, reference, store)
        if (step + 1) % c.config.run.log_every == 0 or step + 1 == algo.steps:
            logger.log(step + 1, algo.name, metrics)
    logger.display.stop()
