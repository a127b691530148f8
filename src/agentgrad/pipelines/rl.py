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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentgrad.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageParams, masked_whiten
from agentgrad.algos.kl import KLController, kl_estimate, kl_loss, kl_reward_penalty, make_kl_controller, sequence_kl
from agentgrad.algos.losses import masked_mean, ppo_clip_loss, value_loss
from agentgrad.algos.task_sampling import KindCounts, kind_weight, observe, signal_rate, weighted_pick
from agentgrad.algos.values import explained_variance
from agentgrad.backends.base import SamplingParams
from agentgrad.backends.scoring import Scoring
from agentgrad.batch import TokenBatch
from agentgrad.data.filters import select_signal_groups
from agentgrad.data.replay import ReplayBuffer
from agentgrad.data.store import TrajectoryStore
from agentgrad.faults import kill_point
from agentgrad.logging import RunLogger
from agentgrad.models.value import Critic, build_critic
from agentgrad.pipelines.async_rollout import RolloutPrefetch, drop_stale
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.faults import NonFiniteGuard, fault_metrics, mask_tool_faults
from agentgrad.pipelines.guidance import with_expert_samples
from agentgrad.pipelines.mismatch import monitor_mismatch
from agentgrad.pipelines.replay import (
    add_fresh,
    build_replay,
    off_policy_correction,
    plan_step,
    sample_replay,
    update_success_ema,
)
from agentgrad.pipelines.rollout_backend import run_rollout
from agentgrad.pipelines.run_state import Stage, StepHook, run_alone
from agentgrad.registry import Registry
from agentgrad.rewards.base import score
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


@dataclass
class RLState:
    """What lives across RL steps besides the policy: the frozen reference, the KL controller, the critic, the
    replay buffer and the measured success that moves its mix, the non-finite-loss count. `state_dict` holds all
    of it, so a resumed run continues exactly (everything else a step samples depends only on (seed, step)).
    `scoring` (from config, not saved) is the distribution every ratio and KL is taken on: the rollout's."""

    algorithm: OnlineAlgorithm
    scoring: Scoring
    reference: torch.nn.Module | None
    kl_controller: KLController
    critic: Critic | None
    replay: ReplayBuffer | None = None
    success_ema: float | None = None
    nonfinite: NonFiniteGuard = field(default_factory=lambda: NonFiniteGuard(3))
    warm_critic: bool = False
    """While `algorithm` trains no critic, fit `critic` on the batches' Monte-Carlo returns (the adaptive stage's
    warm-up before PPO takes over)."""
    prefetch: RolloutPrefetch | None = None  # rollout.max_staleness > 0: rollouts started ahead (not saved)
    reference_head: torch.nn.Module | None = None
    """The factored head frozen as the stage starts (rollout.action_head=factored with a KL term): scores the
    head's decisions for the KL as `reference` scores the tokens."""
    kind_counts: dict[str, KindCounts] | None = None
    """algo.task_sampling=signal: each task kind's recent groups and those with signal, which weight the draw."""

    def state_dict(self) -> dict[str, Any]:
        return {"kl_controller": self.kl_controller.state_dict(),
                "critic": self.critic.state_dict() if self.critic is not None else None,
                "reference": self.reference.state_dict() if self.reference is not None else None,
                "reference_head": self.reference_head.state_dict() if self.reference_head is not None else None,
                "replay": self.replay.state_dict() if self.replay is not None else None,
                "success_ema": self.success_ema, "consecutive_nonfinite": self.nonfinite.consecutive,
                "kind_counts": None if self.kind_counts is None else
                {k: [c.groups, c.signal] for k, c in self.kind_counts.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.kl_controller.load_state_dict(state["kl_controller"])
        for target, key in ((self.critic, "critic"), (self.reference, "reference"), (self.replay, "replay"),
                            (self.reference_head, "reference_head")):
            if target is not None and state.get(key) is not None:
                target.load_state_dict(state[key])
        self.success_ema = state["success_ema"]
        self.nonfinite.consecutive = state["consecutive_nonfinite"]
        if self.kind_counts is not None and state.get("kind_counts") is not None:
            self.kind_counts = {k: KindCounts(*v) for k, v in state["kind_counts"].items()}


def start_rl(c: Components, saved: Mapping[str, Any] | None = None, *, algorithm: OnlineAlgorithm | None = None,
             with_critic: bool = False) -> RLState:
    """A stage's fresh RL state (the reference is the policy as the stage starts), or the `saved` one; for
    `algorithm` (default `algo.name`'s), with a critic when it trains one or `with_critic`."""
    algo = c.config.algo
    algorithm = algorithm or ONLINE_ALGORITHMS.get(algo.name)
    reference = reference_head = None
    if algo.kl_coef > 0:
        reference = c.frozen_reference()
        if c.tool_head is not None:
            reference_head = copy.deepcopy(c.tool_head).eval().requires_grad_(False)
    kl_controller = make_kl_controller(algo.kl_controller, algo.kl_coef, target=algo.kl_target,
                                       horizon=algo.kl_horizon_episodes)
    critic = None
    if algorithm.uses_critic or with_critic:
        critic = build_critic(c.loaded.model, c.config.critic.model, lr=c.config.critic.lr, grad_clip=algo.grad_clip)
    state = RLState(algorithm, Scoring(c.config.rollout.temperature), reference, kl_controller, critic,
                    replay=build_replay(c.config), nonfinite=NonFiniteGuard(c.config.faults.max_consecutive_nonfinite),
                    reference_head=reference_head, kind_counts={} if algo.task_sampling == "signal" else None)
    if saved is not None:
        state.load_state_dict(saved)
    return state


# ---- rollout ------------------------------------------------------------------------------------------------


def rl_tasks(c: Components, step: int, round_index: int = 0, n: int | None = None,
             kind_counts: Mapping[str, KindCounts] | None = None) -> list[Task]:
    """`n` (default tasks_per_step) training tasks for `step`; with `kind_counts` (algo.task_sampling=signal)
    kept from a larger uniform pool in proportion to their kind's signal rate."""
    # A seed stream disjoint from the BC demos (seed + 1) and from evaluation (the held-out split); resampling
    # rounds of dynamic sampling draw further tasks from the same stream.
    n = n or c.config.algo.tasks_per_step
    seed = (c.config.run.seed + 1) * 1_000_003 + step + 7_919 * round_index
    if kind_counts is None:
        return c.suite.sample_tasks(n, split="train", seed=seed)
    pool = c.suite.sample_tasks(n * c.config.algo.task_pool, split="train", seed=seed)
    return [pool[i] for i in weighted_pick([kind_weight(kind_counts, task_kind(t)) for t in pool], n, seed)]


def task_kind(task: Task) -> str:
    return str(task.metadata.get("kind", ""))


def sampling_metrics(kind_counts: Mapping[str, KindCounts] | None) -> dict[str, float]:
    return {f"sampling/signal_rate/{k or 'none'}": signal_rate(v) for k, v in (kind_counts or {}).items()}


def rollout_groups(c: Components, tasks: Sequence[Task], step: int, group_size: int | None = None,
                   round_index: int = 0, *, version: int | None = None, weights: dict | None = None
                   ) -> list[TrajectoryGroup]:
    """A group of `group_size` episodes per task, sampled by the live policy (policy version `step`), or by a
    `weights` snapshot of version `version` (async rollouts)."""
    G = group_size or c.config.algo.group_size
    repeated = [t for t in tasks for _ in range(G)]
    r = c.config.rollout
    sampling = SamplingParams(max_new_tokens=c.limits.max_new_tokens_per_turn, temperature=r.temperature, top_p=r.top_p,
                              seed=c.config.run.seed * 7_919 + step + 104_729 * round_index)
    trajectories = run_rollout(c, repeated, G, sampling=sampling, step=step,
                               policy_version=step if version is None else version, weights=weights)
    scored = score(trajectories, c.reward_fn, c.suite)
    groups = [TrajectoryGroup(task, tuple(scored[i * G:(i + 1) * G])) for i, task in enumerate(tasks)]
    return mask_tool_faults(groups) if c.config.faults.mask_tool_faults else groups


@dataclass(frozen=True)
class Rollout:
    """The groups a step trains on, and every group sampled to get them (for metrics and the store)."""

    groups: tuple[TrajectoryGroup, ...]
    sampled: tuple[TrajectoryGroup, ...]
    rounds: int
    metrics: Mapping[str, float] = field(default_factory=dict)  # async rollouts: staleness


def collect_groups(c: Components, step: int, num_groups: int | None = None,
                   prefetch: RolloutPrefetch | None = None, kind_counts: Mapping[str, KindCounts] | None = None
                   ) -> Rollout:
    """`num_groups` (default tasks_per_step) rollout groups, then apply `algo.zero_signal`: keep, filter, or
    resample (DAPO dynamic sampling, Yu et al. 2025: draw new tasks until `num_groups` groups have signal or
    `max_resample_rounds` extra rounds ran). With async rollouts (`prefetch`) the first round is the one started
    ahead, less its groups past the staleness bound, and every round runs on the rollout thread. With
    `algo.expert_samples` the groups kept (and counted for signal) hold the expert's episode too; `sampled` does
    not."""
    algo = c.config.algo
    n = num_groups or algo.tasks_per_step

    def rollout(*args, **kwargs) -> list[TrajectoryGroup]:
        if prefetch is None:
            return rollout_groups(c, *args, **kwargs)
        return prefetch.run_now(rollout_groups, c, *args, **kwargs)

    sampled = prefetch.take(step) if prefetch is not None else None
    if sampled is None:
        sampled = rollout(rl_tasks(c, step, n=n, kind_counts=kind_counts), step)
    metrics: dict[str, float] = {}
    if prefetch is not None:
        sampled, metrics = drop_stale(sampled, step, prefetch.max_staleness)
    guided = with_expert_samples(c, sampled)  # what trains: with algo.expert_samples, the expert in each group
    rounds = 1
    if algo.zero_signal == "resample":
        while sum(not g.is_zero_signal for g in guided) < n and rounds <= algo.max_resample_rounds:
            more = rollout(rl_tasks(c, step, rounds, n=n, kind_counts=kind_counts), step, round_index=rounds)
            sampled, guided = sampled + more, guided + with_expert_samples(c, more)
            rounds += 1
    kept = guided if algo.zero_signal == "keep" else select_signal_groups(guided, n)
    return Rollout(tuple(kept), tuple(sampled), rounds, metrics)


def make_batch(c: Components, groups: Sequence[TrajectoryGroup]) -> TokenBatch:
    samples = [s for g in groups for s in g.samples]
    return c.collate(samples, group_index=[i for i, g in enumerate(groups) for _ in g.samples],
                     head_choices=c.tool_head.choices if c.tool_head is not None else None)


# ---- per-step tensors ---------------------------------------------------------------------------------------


def add_reference(c: Components, state: RLState, batch: TokenBatch) -> TokenBatch:
    """Reference logprobs, and in kl_mode=reward the KL penalty folded into the token rewards."""
    if state.reference is None:
        return batch
    if batch.head is not None and state.reference_head is not None:  # decisions scored by the reference head
        ref = state.scoring.frozen_with_head(state.reference, state.reference_head, batch)  # (B, T)
    else:
        ref = state.scoring.frozen(state.reference, batch)  # (B, T)
    batch = batch.replace(ref_logprobs=ref)
    if c.config.algo.kl_mode == "reward":
        batch = penalise_rewards(batch, state.kl_controller.value)
    return batch


@torch.no_grad()
def add_values(state: RLState, batch: TokenBatch) -> TokenBatch:
    """The critic's values at rollout time: the estimator's V and the clipped value loss's anchor."""
    if state.critic is None:
        return batch
    return batch.replace(values=state.critic.values(batch.input_ids, batch.attention_mask, batch.loss_mask))


def rollout_kl(batch: TokenBatch, unit: str = "episode-sum") -> torch.Tensor:
    """Per-episode KL(behaviour || reference) in algo.kl_target_unit (k1, as Ziegler et al. 2019 measure it for
    the controller): (B,)."""
    return sequence_kl(batch.old_logprobs, batch.ref_logprobs, batch.loss_mask, unit=unit)  # (B,)


@torch.no_grad()
def proximal_logprobs(c: Components, scoring: Scoring, batch: TokenBatch) -> torch.Tensor:
    """The current policy's logprobs of every token before this step's update, minibatch by minibatch: (B, T)."""
    size = c.config.algo.minibatch_size_episodes
    out = torch.zeros_like(batch.old_logprobs)  # (B, T)
    for start in range(0, batch.num_sequences, size):
        rows = torch.arange(start, min(start + size, batch.num_sequences))
        lp = scoring.policy(c.learner, batch.select(rows))  # (b, t)
        out[rows, :lp.shape[1]] = lp
    return out


def correct_off_policy(c: Components, state: RLState, batch: TokenBatch, num_fresh: int
                       ) -> tuple[TokenBatch, dict[str, float]]:
    """Rows from `num_fresh` on were replayed: clip around pi_prox and weight by pi_prox / mu (pipelines.replay).
    The fresh rows go through the mismatch monitor when `mismatch` is on (pipelines.mismatch). pi_prox is scored
    once, and only when one of them needs it; otherwise the batch is returned as it is."""
    has_replayed = num_fresh < batch.num_sequences
    if not has_replayed and not c.config.mismatch.scores:
        return batch, {}
    prox = proximal_logprobs(c, state.scoring, batch)  # (B, T)
    metrics: dict[str, float] = {}
    if has_replayed:
        replayed = torch.arange(batch.num_sequences, device=batch.loss_mask.device) >= num_fresh  # (B,)
        batch, metrics = off_policy_correction(c.config, batch, prox, replayed)
    if c.config.mismatch.scores:
        batch, monitored = monitor_mismatch(c.config.mismatch, batch, prox, num_fresh)
        metrics |= monitored
    return batch, metrics


def adapt_kl_coef(state: RLState, batch: TokenBatch, unit: str = "episode-sum") -> dict[str, float]:
    """Feed the measured KL to the controller (a no-op for the fixed one); the next step uses the new value."""
    if batch.ref_logprobs is None:
        return {}
    kl = rollout_kl(batch, unit).mean().item()
    state.kl_controller.update(kl, n_steps=batch.num_sequences)
    return {"rollout/kl_ref": kl}


def penalise_rewards(batch: TokenBatch, coef: float) -> TokenBatch:
    kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k1", batch.loss_mask)  # (B, T)
    return batch.replace(token_rewards=kl_reward_penalty(batch.token_rewards, kl, coef, batch.loss_mask))


def compute_advantages(c: Components, batch: TokenBatch, algorithm: OnlineAlgorithm) -> TokenBatch:
    algo = c.config.algo
    estimator = ADVANTAGE_ESTIMATORS.get(algo.advantage_estimator or algorithm.estimator)
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
        order = shuffled_rows(batch.group_index, algo.minibatch_size_episodes, generator)
        for start in range(0, batch.num_sequences, algo.minibatch_size_episodes):
            yield batch.select(order[start:start + algo.minibatch_size_episodes])


def shuffled_rows(group_index: torch.Tensor, minibatch_size: int, generator: torch.Generator) -> torch.Tensor:
    """A random order of the rows (B,) that shuffles whole groups when all groups have one size (> 1) dividing
    the minibatch size, so a group's samples share a minibatch and the learner runs their prompt once
    (`backends.shared_prefix`); otherwise a shuffle of single rows."""
    _, rows_per_group = torch.unique(group_index, return_counts=True)  # (G,)
    size = int(rows_per_group[0])
    if size == 1 or minibatch_size % size or bool((rows_per_group != size).any()):
        return torch.randperm(len(group_index), generator=generator)
    by_group = torch.argsort(group_index, stable=True).view(-1, size)  # (G, size) row ids, a group per line
    return by_group[torch.randperm(len(by_group), generator=generator)].flatten()  # (B,)


def agg_norm(c: Components) -> int:
    """seq-mean-token-sum-norm's divisor: a constant for the whole run (Dr.GRPO), never the batch's own width."""
    return c.config.algo.loss_agg_norm or c.config.rollout.max_total_tokens


def policy_loss(c: Components, scoring: Scoring, mb: TokenBatch, kl_coef: float
                ) -> tuple[torch.Tensor, dict[str, float]]:
    algo = c.config.algo
    logprobs = scoring.policy(c.learner, mb)  # (b, T)
    pl = ppo_clip_loss(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, clip_low=algo.clip_low,
                       clip_high=algo.clip_high, dual_clip=algo.dual_clip, agg=algo.loss_agg,
                       agg_norm=agg_norm(c), is_weights=mb.is_weights)
    metrics = {"loss/policy": pl.loss.item(), "loss/clipfrac": pl.clipfrac.item(),
               "loss/approx_kl_old": pl.approx_kl.item()}
    loss = pl.loss
    if mb.ref_logprobs is not None and algo.kl_mode == "loss":
        kl = kl_loss(logprobs, mb.ref_logprobs, mb.loss_mask, kind=algo.kl_estimator, agg=algo.loss_agg,
                     agg_norm=agg_norm(c))
        loss = loss + kl_coef * kl
        metrics["loss/kl"] = kl.item()
    return loss, metrics


def value_update(c: Components, critic: Critic, mb: TokenBatch) -> dict[str, float]:
    values = critic.values(mb.input_ids, mb.attention_mask, mb.loss_mask)  # (b, T)
    vl = value_loss(values, mb.values, mb.returns, mb.loss_mask, clip=c.config.critic.value_clip,
                    agg=c.config.algo.loss_agg, agg_norm=agg_norm(c))
    return {"loss/value": vl.loss.item(), "loss/value_clipfrac": vl.clipfrac.item(), **critic.step(vl.loss)}


def policy_update(c: Components, batch: TokenBatch, state: RLState, step: int = 0) -> dict[str, float]:
    """`epochs_per_step` passes of clipped policy-gradient updates (and value updates) over minibatches. An
    update whose loss is not finite is skipped (parameters unchanged) and counted; `state.nonfinite` aborts
    the run after `faults.max_consecutive_nonfinite` in a row."""
    trains_critic = state.algorithm.uses_critic
    if not trains_critic and not bool((batch.advantages * batch.loss_mask).any()):
        # Every group was zero-signal: a step would only replay Adam's momentum from earlier batches.
        return {"train/updates": 0.0, "train/no_signal_steps": 1.0}
    totals: Counter = Counter()
    n_updates = 0
    early_stops = 0
    for mb in minibatches(c, batch):
        loss, metrics = policy_loss(c, state.scoring, mb, state.kl_controller.value)
        if not state.nonfinite.check(loss):
            n_updates += 1
            c.learner.optimizer.zero_grad(set_to_none=True)  # skipped: the parameters stay as they were
            totals["faults/nonfinite_losses"] += 1
            continue
        if c.config.algo.target_kl is not None and metrics["loss/approx_kl_old"] > c.config.algo.target_kl:
            # Drifted too far from the sampling policy (CleanRL's target_kl): at low sampling temperature the
            # remaining epochs on this batch can collapse the policy (measured: one such step, then 0% success).
            early_stops = 1
            break
        n_updates += 1
        totals.update(metrics)
        totals.update(c.learner.step(loss))
        kill_point("update", step)
        if trains_critic:
            totals.update(value_update(c, state.critic, mb))
    out = {k: v / max(1, n_updates) for k, v in totals.items()}
    out |= {"faults/nonfinite_losses": float(totals["faults/nonfinite_losses"]),
            "faults/nonfinite_grads": float(totals["train/skipped_steps"]), "train/kl_early_stops": float(early_stops)}
    return out | {"train/updates": float(n_updates), "train/no_signal_steps": 0.0}


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


def monte_carlo_returns(c: Components, batch: TokenBatch) -> torch.Tensor:
    """Each policy token's discounted reward-to-go (algo.gamma per policy token, no bootstrap): GAE with lambda 1
    and V = 0, the target PPO's value loss approaches as its lambda nears 1. (B, T)"""
    values = torch.zeros_like(batch.token_rewards, dtype=torch.float32)  # (B, T)
    out = ADVANTAGE_ESTIMATORS.get("gae")(batch.token_rewards, batch.loss_mask, batch.group_index, values,
                                          AdvantageParams(gamma=c.config.algo.gamma, lam=1.0))
    return out.returns  # (B, T)


def warm_critic(c: Components, critic: Critic, batch: TokenBatch) -> dict[str, float]:
    """Fit the critic on a critic-free algorithm's batch (`batch.returns`: its Monte-Carlo returns), as PPO's
    value updates would: epochs_per_step passes of the clipped value loss over the same minibatches."""
    totals: Counter = Counter()
    n = 0
    for mb in minibatches(c, batch):
        totals.update(value_update(c, critic, mb))
        n += 1
    return {k: v / max(1, n) for k, v in totals.items()}


def critic_metrics(batch: TokenBatch) -> dict[str, float]:
    if batch.values is None:
        return {}
    return {"critic/value_mean": masked_mean(batch.values, batch.loss_mask).item(),
            "critic/explained_variance": explained_variance(batch.values, batch.returns, batch.loss_mask).item()}


# ---- the step -----------------------------------------------------------------------------------------------


def mix_replay(c: Components, state: RLState, rollout: Rollout, step: int, num_replayed: int
               ) -> tuple[list[TrajectoryGroup], dict[str, float]]:
    """The step's training groups: its fresh groups, then `num_replayed` drawn from the buffer before this
    step's groups join it. Also moves the success EMA that schedules the mix."""
    replayed = sample_replay(c.config, state.replay, num_replayed, step)
    add_fresh(c.config, state.replay, rollout.sampled, step)
    samples = [s for g in rollout.sampled for s in g.samples]
    state.success_ema = update_success_ema(c.config, state.success_ema, sum(s.success for s in samples) / len(samples))
    return [*rollout.groups, *replayed], {
        "replay/fresh_groups": float(len(rollout.groups)), "replay/replayed_groups": float(len(replayed)),
        "replay/buffer_groups": float(len(state.replay) if state.replay is not None else 0)}


def rl_step(c: Components, step: int, state: RLState, store: TrajectoryStore | None) -> dict[str, float]:
    t0 = time.perf_counter()
    num_fresh, num_replayed = plan_step(c.config, state.replay, state.success_ema or 0.0)
    rollout = collect_groups(c, step, num_fresh, state.prefetch, state.kind_counts)
    if state.kind_counts is not None:
        state.kind_counts = observe(state.kind_counts, ((task_kind(g.task), not g.is_zero_signal)
                                                        for g in rollout.sampled))
    if state.prefetch is not None:  # the next steps sample with the weights before this update, as it runs
        state.prefetch.start_ahead(step, lambda: {k: v.detach().clone()
                                                  for k, v in c.loaded.model.state_dict().items()})
    kill_point("rollout", step)
    t_rollout = time.perf_counter() - t0
    if store is not None:
        store.append([s for g in rollout.sampled for s in g.samples], step=step, stage="rl",
                     groups=[f"{step}:{i}" for i, g in enumerate(rollout.sampled) for _ in g.samples])
    metrics = rollout_metrics(rollout.sampled) | fault_metrics(rollout.sampled) | {
        "rollout/rounds": float(rollout.rounds), "rollout/groups_trained": float(len(rollout.groups)),
        "train/kl_coef": state.kl_controller.value, **rollout.metrics, **sampling_metrics(state.kind_counts)}
    if c.rollout_runner is not None:
        metrics |= c.rollout_runner.metrics()
    groups, replay_metrics = mix_replay(c, state, rollout, step, num_replayed)
    metrics |= replay_metrics
    if groups:
        batch = make_batch(c, groups)
        batch, correction = correct_off_policy(c, state, batch, num_fresh=sum(len(g.samples) for g in rollout.groups))
        metrics |= correction
        batch = add_reference(c, state, batch)
        batch = add_values(state, batch)
        batch = compute_advantages(c, batch, state.algorithm)
        idle_critic = state.critic is not None and not state.algorithm.uses_critic
        if idle_critic:  # what the critic is measured (and warmed) on; the policy loss reads no returns
            batch = batch.replace(returns=monte_carlo_returns(c, batch))
        metrics |= policy_update(c, batch, state, step)
        if idle_critic and state.warm_critic:  # after its values were taken: they are measured on unseen data
            metrics |= warm_critic(c, state.critic, batch)
        metrics |= adapt_kl_coef(state, batch, c.config.algo.kl_target_unit)
        metrics |= critic_metrics(batch)
    else:  # dynamic sampling found no group with signal
        metrics |= {"train/updates": 0.0, "train/no_signal_steps": 1.0}
    elapsed = time.perf_counter() - t0
    return metrics | {"perf/step_s": elapsed, "perf/rollout_s": t_rollout,
                      "perf/tokens_per_s": metrics["rollout/generated_tokens"] / max(t_rollout, 1e-9)}


def _start(c: Components, logger: RunLogger, first_step: int, saved: Mapping[str, Any] | None) -> RLState:
    state = start_rl(c, saved)
    c.learner.set_lr(c.config.algo.lr)
    k = c.config.rollout.max_staleness
    if k > 0:
        n = c.config.algo.tasks_per_step
        state.prefetch = RolloutPrefetch(k, first_step + c.config.algo.steps - 1, lambda step, version, weights:
                                         rollout_groups(c, rl_tasks(c, step, n=n, kind_counts=state.kind_counts),
                                                        step, version=version,
                                                        weights=weights))
    return state


def _finish(c: Components, logger: RunLogger, state: RLState, position: Any) -> None:
    prefetch = getattr(state, "prefetch", None)  # a stand-in state (tests of the step loop) has none
    if prefetch is not None:
        prefetch.close()


ONLINE_STAGE: Stage[RLState] = Stage(
    budget=lambda config: config.algo.steps, start=_start, finish=_finish, warns_slow_steps=True,
    step=lambda c, logger, store, state, step: rl_step(c, step, state, store))
"""Every online algorithm's stage (steps numbered globally: task and sampling seeds follow the step number, so a
later stage never replays an earlier stage's tasks)."""


def run_rl(c: Components, logger: RunLogger, store: TrajectoryStore | None = None, *,
           state: RLState | None = None, on_step: StepHook | None = None, first_step: int = 0) -> int:
    """`algo.steps` steps of the configured online algorithm alone (no schedule, no checkpoints), numbered from
    `first_step`. Returns the steps taken: fewer when `on_step(step, metrics)` returned True."""
    if state is not None and c.config.algo.steps:
        c.learner.set_lr(c.config.algo.lr)
    return run_alone(c.config.algo.name, ONLINE_STAGE, c, logger, store, on_step=on_step, first_step=first_step,
                     state=state)
