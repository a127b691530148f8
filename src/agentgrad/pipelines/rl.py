"""Online RL (grpo, rloo, reinforce_pp, ppo): rollout groups -> score -> collate -> values -> KL -> advantages ->
clipped update (+ value update).

One step reads top to bottom like CleanRL's ppo.py (`rl_step`); the math lives in `agentgrad.algos`. The
algorithms differ only in what `ONLINE_ALGORITHMS` records for them: the advantage estimator and whether a
value model is trained. Everything else (KL to a frozen reference, its controller, dynamic sampling) is config.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from agentgrad.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageParams, masked_whiten
from agentgrad.algos.kl import KLController, kl_estimate, kl_loss, kl_reward_penalty, make_kl_controller
from agentgrad.algos.losses import masked_mean, ppo_clip_loss, value_loss
from agentgrad.algos.values import explained_variance
from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import token_logprobs
from agentgrad.batch import TokenBatch, collate
from agentgrad.data.filters import select_signal_groups
from agentgrad.data.store import TrajectoryStore
from agentgrad.logging import RunLogger
from agentgrad.models.value import Critic, build_critic
from agentgrad.pipelines.components import Components
from agentgrad.registry import Registry
from agentgrad.rewards.base import score
from agentgrad.rollout.loop import run_episodes
from agentgrad.types import ScoredTrajectory, Task, TrajectoryGroup


@dataclass(frozen=True)
class OnlineAlgorithm:
    """What tells the online algorithms apart; `rl_step` is the same for all of them."""

    estimator: str
    """Name in `ADVANTAGE_ESTIMATORS`."""
    uses_critic: bool = False
    """Train a value model (`critic` config) whose values feed the estimator."""


ONLINE_ALGORITHMS: Registry[OnlineAlgorithm] = Registry("online RL algorithm")
ONLINE_ALGORITHMS.add("grpo", OnlineAlgorithm("grpo"))  # Shao et al. 2024; Dr.GRPO with algo.norm_by_std=false
ONLINE_ALGORITHMS.add("rloo", OnlineAlgorithm("rloo"))  # Ahmadian et al. 2024
ONLINE_ALGORITHMS.add("reinforce_pp", OnlineAlgorithm("reinforce_pp"))  # Hu 2025
ONLINE_ALGORITHMS.add("ppo", OnlineAlgorithm("gae", uses_critic=True))  # Schulman et al. 2017, Ziegler et al. 2019


StepHook = Callable[[int, Mapping[str, float]], bool]
"""(global step number, the step's metrics) -> True to end the stage after this step."""


@dataclass
class RLState:
    """What lives across RL steps besides the policy: the frozen reference, the KL controller, the critic."""

    algorithm: OnlineAlgorithm
    reference: torch.nn.Module | None
    kl_controller: KLController
    critic: Critic | None


def start_rl(c: Components) -> RLState:
    algo = c.config.algo
    algorithm = ONLINE_ALGORITHMS.get(algo.name)
    reference = None
    if algo.kl_coef > 0:
        reference = copy.deepcopy(c.loaded.model).eval().requires_grad_(False)
    kl_controller = make_kl_controller(algo.kl_controller, algo.kl_coef, target=algo.kl_target,
                                       horizon=algo.kl_horizon_episodes)
    critic = None
    if algorithm.uses_critic:
        critic = build_critic(c.loaded.model, c.config.critic.model, lr=c.config.critic.lr, grad_clip=algo.grad_clip)
    return RLState(algorithm, reference, kl_controller, critic)


# ---- rollout ------------------------------------------------------------------------------------------------


def rl_tasks(c: Components, step: int, round_index: int = 0, n: int | None = None) -> list[Task]:
    # A seed stream disjoint from the BC demos (seed + 1) and from evaluation (the held-out split); resampling
    # rounds of dynamic sampling draw further tasks from the same stream.
    return c.suite.sample_tasks(n or c.config.algo.tasks_per_step, split="train",
                                seed=(c.config.run.seed + 1) * 1_000_003 + step + 7_919 * round_index)


def rollout_groups(c: Components, tasks: Sequence[Task], step: int, group_size: int | None = None,
                   round_index: int = 0) -> list[TrajectoryGroup]:
    G = group_size or c.config.algo.group_size
    repeated = [t for t in tasks for _ in range(G)]
    r = c.config.rollout
    sampling = SamplingParams(max_new_tokens=c.limits.max_new_tokens_per_turn, temperature=r.temperature, top_p=r.top_p,
                              seed=c.config.run.seed * 7_919 + step + 104_729 * round_index)
    trajectories = run_episodes(c.policy, c.codec, [c.suite.make_env() for _ in repeated], repeated,
                                sampling=sampling, limits=c.limits,
                                sample_indices=[i % G for i in range(len(repeated))], policy_version=step)
    scored = score(trajectories, c.reward_fn, c.suite)
    return [TrajectoryGroup(task, tuple(scored[i * G:(i + 1) * G])) for i, task in enumerate(tasks)]


@dataclass(frozen=True)
class Rollout:
    """The groups a step trains on, and every group sampled to get them (for metrics and the store)."""

    groups: tuple[TrajectoryGroup, ...]
    sampled: tuple[TrajectoryGroup, ...]
    rounds: int


def collect_groups(c: Components, step: int) -> Rollout:
    """Rollout groups, then apply `algo.zero_signal`: keep, filter, or resample (DAPO dynamic sampling, Yu et al.
    2025: draw new tasks until `tasks_per_step` groups have signal or `max_resample_rounds` extra rounds ran)."""
    algo = c.config.algo
    sampled = rollout_groups(c, rl_tasks(c, step), step)
    rounds = 1
    if algo.zero_signal == "resample":
        while (sum(not g.is_zero_signal for g in sampled) < algo.tasks_per_step
               and rounds <= algo.max_resample_rounds):
            sampled += rollout_groups(c, rl_tasks(c, step, rounds), step, round_index=rounds)
            rounds += 1
    if algo.zero_signal == "keep":
        kept = sampled
    else:
        kept = select_signal_groups(sampled, algo.tasks_per_step)
    return Rollout(tuple(kept), tuple(sampled), rounds)


def make_batch(c: Components, groups: Sequence[TrajectoryGroup]) -> TokenBatch:
    samples = [s for g in groups for s in g.samples]
    return collate(samples, pad_token_id=c.pad_token_id,
                   group_index=[i for i, g in enumerate(groups) for _ in g.samples])


# ---- per-step tensors ---------------------------------------------------------------------------------------


@torch.no_grad()
def reference_logprobs(reference: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    return token_logprobs(reference, batch.input_ids, batch.attention_mask, temperature)  # (B, T)


def add_reference(c: Components, state: RLState, batch: TokenBatch) -> TokenBatch:
    """Reference logprobs, and in kl_mode=reward the KL penalty folded into the token rewards."""
    if state.reference is None:
        return batch
    batch = batch.replace(ref_logprobs=reference_logprobs(state.reference, batch, c.config.rollout.temperature))
    if c.config.algo.kl_mode == "reward":
        batch = penalise_rewards(batch, state.kl_controller.value)
    return batch


@torch.no_grad()
def add_values(state: RLState, batch: TokenBatch) -> TokenBatch:
    """The critic's values at rollout time: the estimator's V and the clipped value loss's anchor."""
    if state.critic is None:
        return batch
    return batch.replace(values=state.critic.values(batch.input_ids, batch.attention_mask, batch.loss_mask))


def rollout_kl(batch: TokenBatch) -> torch.Tensor:
    """Per-episode KL(behaviour || reference), summed over each episode's policy tokens (k1, as Ziegler et al.
    2019 measure it for the controller): (B,)."""
    kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k1", batch.loss_mask)  # (B, T)
    return kl.sum(dim=1)  # (B,)


def adapt_kl_coef(state: RLState, batch: TokenBatch) -> dict[str, float]:
    """Feed the measured KL to the controller (a no-op for the fixed one); the next step uses the new value."""
    if batch.ref_logprobs is None:
        return {}
    kl = rollout_kl(batch).mean().item()
    state.kl_controller.update(kl, n_steps=batch.num_sequences)
    return {"rollout/kl_ref": kl}


def penalise_rewards(batch: TokenBatch, coef: float) -> TokenBatch:
    kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k1", batch.loss_mask)  # (B, T)
    return batch.replace(token_rewards=kl_reward_penalty(batch.token_rewards, kl, coef, batch.loss_mask))


def compute_advantages(c: Components, batch: TokenBatch, algorithm: OnlineAlgorithm) -> TokenBatch:
    algo = c.config.algo
    estimator = ADVANTAGE_ESTIMATORS.get(algorithm.estimator)
    out = estimator(batch.token_rewards, batch.loss_mask, batch.group_index, batch.values,
                    AdvantageParams(gamma=algo.gamma, lam=algo.gae_lambda, norm_by_std=algo.norm_by_std))
    advantages = out.advantages  # (B, T)
    if algorithm.uses_critic and c.config.critic.whiten_advantages:
        advantages = masked_whiten(advantages, batch.loss_mask)  # (B, T)
    return batch.replace(advantages=advantages, returns=out.returns)


# ---- update -------------------------------------------------------------------------------------------------


def minibatches(c: Components, batch: TokenBatch):
    algo = c.config.algo
    generator = torch.Generator().manual_seed(c.config.run.seed)
    for _ in range(algo.epochs_per_step):
        order = torch.randperm(batch.num_sequences, generator=generator)
        for start in range(0, batch.num_sequences, algo.minibatch_size_episodes):
            yield batch.select(order[start:start + algo.minibatch_size_episodes])


def policy_loss(c: Components, mb: TokenBatch, kl_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    algo = c.config.algo
    logprobs = c.learner.logprobs(mb, temperature=c.config.rollout.temperature)  # (b, T)
    pl = ppo_clip_loss(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, clip_low=algo.clip_low,
                       clip_high=algo.clip_high, dual_clip=algo.dual_clip, agg=algo.loss_agg)
    metrics = {"loss/policy": pl.loss.item(), "loss/clipfrac": pl.clipfrac.item(),
               "loss/approx_kl_old": pl.approx_kl.item()}
    loss = pl.loss
    if mb.ref_logprobs is not None and algo.kl_mode == "loss":
        kl = kl_loss(logprobs, mb.ref_logprobs, mb.loss_mask, kind=algo.kl_estimator, agg=algo.loss_agg)
        loss = loss + kl_coef * kl
        metrics["loss/kl"] = kl.item()
    return loss, metrics


def value_update(c: Components, critic: Critic, mb: TokenBatch) -> dict[str, float]:
    values = critic.values(mb.input_ids, mb.attention_mask, mb.loss_mask)  # (b, T)
    vl = value_loss(values, mb.values, mb.returns, mb.loss_mask, clip=c.config.critic.value_clip,
                    agg=c.config.algo.loss_agg)
    return {"loss/value": vl.loss.item(), "loss/value_clipfrac": vl.clipfrac.item(), **critic.step(vl.loss)}


def policy_update(c: Components, batch: TokenBatch, state: RLState) -> dict[str, float]:
    """`epochs_per_step` passes of clipped policy-gradient updates (and value updates) over minibatches."""
    if state.critic is None and not bool((batch.advantages * batch.loss_mask).any()):
        # Every group was zero-signal: a step would only replay Adam's momentum from earlier batches.
        return {"train/updates": 0.0, "train/no_signal_steps": 1.0}
    totals: Counter = Counter()
    n_updates = 0
    for mb in minibatches(c, batch):
        loss, metrics = policy_loss(c, mb, state.kl_controller.value)
        totals.update(metrics)
        totals.update(c.learner.step(loss))
        if state.critic is not None:
            totals.update(value_update(c, state.critic, mb))
        n_updates += 1
    return {k: v / n_updates for k, v in totals.items()} | {"train/updates": float(n_updates),
                                                           "train/no_signal_steps": 0.0}


# ---- metrics ------------------------------------------------------------------------------------------------


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


def critic_metrics(batch: TokenBatch) -> dict[str, float]:
    if batch.values is None:
        return {}
    return {"critic/value_mean": masked_mean(batch.values, batch.loss_mask).item(),
            "critic/explained_variance": explained_variance(batch.values, batch.returns, batch.loss_mask).item()}


# ---- the step -----------------------------------------------------------------------------------------------


def rl_step(c: Components, step: int, state: RLState, store: TrajectoryStore | None) -> dict[str, float]:
    t0 = time.perf_counter()
    rollout = collect_groups(c, step)
    t_rollout = time.perf_counter() - t0
    if store is not None:
        store.append([s for g in rollout.sampled for s in g.samples], step=step, stage="rl")
    metrics = rollout_metrics(rollout.sampled) | {"rollout/rounds": float(rollout.rounds),
                                                  "rollout/groups_trained": float(len(rollout.groups)),
                                                  "train/kl_coef": state.kl_controller.value}
    if rollout.groups:
        batch = make_batch(c, rollout.groups)
        batch = add_reference(c, state, batch)
        batch = add_values(state, batch)
        batch = compute_advantages(c, batch, state.algorithm)
        metrics |= policy_update(c, batch, state)
        metrics |= adapt_kl_coef(state, batch)
        metrics |= critic_metrics(batch)
    else:  # dynamic sampling found no group with signal
        metrics |= {"train/updates": 0.0, "train/no_signal_steps": 1.0}
    elapsed = time.perf_counter() - t0
    return metrics | {"perf/step_s": elapsed, "perf/rollout_s": t_rollout,
                      "perf/tokens_per_s": metrics["rollout/generated_tokens"] / max(t_rollout, 1e-9)}


def run_rl(c: Components, logger: RunLogger, store: TrajectoryStore | None = None, *,
           state: RLState | None = None, on_step: StepHook | None = None, first_step: int = 0) -> int:
    """Run `algo.steps` steps of the configured online algorithm, numbered from `first_step` (task and sampling
    seeds follow the step number, so a later stage never replays an earlier stage's tasks). Returns the steps
    taken: fewer when `on_step(step, metrics)` (the schedule's switch condition) returned True."""
    algo = c.config.algo
    if algo.steps == 0:
        return 0
    state = state or start_rl(c)
    c.learner.set_lr(algo.lr)
    logger.display.start(algo.name, first_step + algo.steps)
    try:
        for i in range(algo.steps):
            step = first_step + i
            metrics = rl_step(c, step, state, store)
            stop = on_step is not None and on_step(step + 1, metrics)
            if stop or (step + 1) % c.config.run.log_every == 0 or i + 1 == algo.steps:
                logger.log(step + 1, algo.name, metrics)
            if stop:
                return i + 1
    finally:
        logger.display.stop()
    return algo.steps
