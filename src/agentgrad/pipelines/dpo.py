"""Online DPO from rollouts: pairs of a successful and a failed trajectory of the same task (sampled with the
current policy), trained with the DPO loss (Rafailov et al. 2023) against the policy frozen at stage start,
plus an NLL term on the chosen trajectories (`dpo.nll_coef`; Pang et al. 2024, "Iterative Reasoning Preference
Optimization", whose pairs are correct and incorrect solutions as ours are).

Log-probabilities are taken at temperature 1 (the model's own distribution, which DPO's implicit reward is
defined on), on policy tokens only (`batch.loss_mask`), so observations and prompts never enter the margin.
Policy and reference are scored by one `Scoring`, so under constrained decoding both are the softmax over each
token's legal set: scoring only one side masked would put the masks' normalisers into the margin.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentgrad.algos.losses import dpo_loss, sequence_logprobs, sft_loss
from agentgrad.backends.scoring import Scoring
from agentgrad.batch import TokenBatch
from agentgrad.data.filters import preference_pairs
from agentgrad.data.store import TrajectoryStore
from agentgrad.faults import kill_point
from agentgrad.logging import RunLogger
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.rl import rl_tasks, rollout_groups, rollout_metrics
from agentgrad.pipelines.run_state import Stage
from agentgrad.types import ScoredTrajectory


def pair_batches(c: Components, pairs: Sequence[tuple[ScoredTrajectory, ScoredTrajectory]]
                 ) -> tuple[TokenBatch, TokenBatch]:
    chosen = c.collate([p[0] for p in pairs])
    rejected = c.collate([p[1] for p in pairs])
    return chosen, rejected


SCORING = Scoring(temperature=1.0)


def frozen_sequence_logprobs(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    return sequence_logprobs(SCORING.frozen(model, batch), batch.loss_mask)  # (N,)


def dpo_update(c: Components, chosen: TokenBatch, rejected: TokenBatch, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor, rng: random.Random, step: int = 0) -> dict[str, float]:
    cfg = c.config.dpo
    totals: Counter = Counter()
    n_updates = 0
    for _ in range(cfg.epochs):
        order = list(range(chosen.num_sequences))
        rng.shuffle(order)
        for start in range(0, len(order), cfg.batch_size_pairs):
            rows = torch.tensor(order[start:start + cfg.batch_size_pairs])
            w, lose = chosen.select(rows), rejected.select(rows)
            chosen_logprobs = SCORING.policy(c.learner, w)  # (b, T)
            out = dpo_loss(sequence_logprobs(chosen_logprobs, w.loss_mask),
                           sequence_logprobs(SCORING.policy(c.learner, lose), lose.loss_mask),
                           ref_chosen[rows], ref_rejected[rows], beta=cfg.beta, label_smoothing=cfg.label_smoothing)
            nll = sft_loss(chosen_logprobs, w.loss_mask)
            totals.update(c.learner.step(out.loss + cfg.nll_coef * nll))
            kill_point("update", step)
            totals.update({"loss/dpo": out.loss.item(), "loss/dpo_nll": nll.item(),
                           "dpo/reward_margin": out.reward_margin.item(),
                           "dpo/reward_accuracy": out.reward_accuracy.item()})
            n_updates += 1
    return {k: v / n_updates for k, v in totals.items()} | {"train/updates": float(n_updates)}


@dataclass
class DPOState:
    reference: torch.nn.Module
    """The policy frozen as the stage started."""
    rng: random.Random
    """Shuffles the pairs."""

    def state_dict(self) -> dict[str, Any]:
        return {"reference": self.reference.state_dict(), "rng": self.rng.getstate()}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.reference.load_state_dict(saved["reference"])
        self.rng.setstate(saved["rng"])


def start_dpo(c: Components, logger: RunLogger, first_step: int, saved: Mapping[str, Any] | None) -> DPOState:
    state = DPOState(c.frozen_reference(),
                     random.Random(c.config.run.seed + first_step))
    c.learner.set_lr(c.config.dpo.lr)
    if saved is not None:
        state.load_state_dict(saved)
    return state


def dpo_step(c: Components, logger: RunLogger, store: TrajectoryStore | None, state: DPOState,
             step: int) -> dict[str, float]:
    cfg = c.config.dpo
    t0 = time.perf_counter()
    groups = rollout_groups(c, rl_tasks(c, step, n=cfg.tasks_per_iteration), step, group_size=cfg.samples_per_task)
    kill_point("rollout", step)
    if store is not None:
        store.append([s for g in groups for s in g.samples], step=step, stage="dpo")
    pairs = preference_pairs(groups)
    metrics = rollout_metrics(groups) | {"dpo/pairs": float(len(pairs))}
    if pairs:
        chosen, rejected = pair_batches(c, pairs)
        ref_chosen = frozen_sequence_logprobs(state.reference, chosen)  # (N,)
        ref_rejected = frozen_sequence_logprobs(state.reference, rejected)  # (N,)
        metrics |= dpo_update(c, chosen, rejected, ref_chosen, ref_rejected, state.rng, step)
    else:
        metrics["train/updates"] = 0.0
    return metrics | {"perf/step_s": time.perf_counter() - t0}


DPO_STAGE: Stage[DPOState] = Stage(budget=lambda config: config.dpo.iterations, start=start_dpo, step=dpo_step,
                                   log_every_step=True)
"""`dpo.iterations` rollout/train iterations against the policy frozen at stage start."""
