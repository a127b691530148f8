"""ReST (Gulcehre et al. 2023, "Reinforced Self-Training"): Grow, then Improve, repeated.

Grow: sample `samples_per_task` trajectories per task with the current policy. Improve: keep the trajectories
whose reward reaches a threshold that rises with each iteration (`data.filters.rest_threshold`) and fine-tune
on them with the SFT loss. Our Grow sets are small and fresh each iteration (ReST^EM-like, Singh et al. 2023),
so one Improve step follows each Grow step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentgrad.algos.losses import sft_loss
from agentgrad.batch import collate
from agentgrad.data.filters import above_threshold, rest_threshold
from agentgrad.data.store import TrajectoryStore
from agentgrad.faults import kill_point
from agentgrad.logging import RunLogger
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.rl import rl_tasks, rollout_groups, rollout_metrics
from agentgrad.pipelines.run_state import Stage
from agentgrad.types import ScoredTrajectory, TrajectoryGroup


def grow(c: Components, step: int) -> list[TrajectoryGroup]:
    cfg = c.config.rest
    tasks = rl_tasks(c, step, n=cfg.tasks_per_iteration)
    return rollout_groups(c, tasks, step, group_size=cfg.samples_per_task)


def improve(c: Components, kept: Sequence[ScoredTrajectory], rng: random.Random, step: int = 0) -> dict[str, float]:
    """`sft_steps` SFT steps on minibatches drawn from the kept trajectories."""
    cfg = c.config.rest
    if not kept or cfg.sft_steps == 0:
        return {"train/updates": 0.0}
    c.learner.set_lr(cfg.lr)
    losses = []
    for _ in range(cfg.sft_steps):
        batch = collate(rng.sample(list(kept), min(cfg.batch_size_episodes, len(kept))), pad_token_id=c.pad_token_id)
        loss = sft_loss(c.learner.logprobs(batch), batch.loss_mask)
        c.learner.step(loss)
        kill_point("update", step)
        losses.append(loss.item())
    return {"loss/sft": sum(losses) / len(losses), "train/updates": float(cfg.sft_steps)}


@dataclass
class RestState:
    first_step: int
    """Number of the stage's first iteration: the threshold rises with the iterations since."""
    rng: random.Random
    """Draws the Improve minibatches."""

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.rng.setstate(saved["rng"])


def start_rest(c: Components, logger: RunLogger, first_step: int, saved: Mapping[str, Any] | None) -> RestState:
    state = RestState(first_step, random.Random(c.config.run.seed + first_step))
    if saved is not None:
        state.load_state_dict(saved)
    return state


def rest_step(c: Components, logger: RunLogger, store: TrajectoryStore | None, state: RestState,
              step: int) -> dict[str, float]:
    cfg = c.config.rest
    t0 = time.perf_counter()
    groups = grow(c, step)
    kill_point("rollout", step)
    samples = [s for g in groups for s in g.samples]
    if store is not None:
        store.append(samples, step=step, stage="rest")
    threshold = rest_threshold(step - state.first_step, start=cfg.threshold_start,
                               increment=cfg.threshold_increment, maximum=cfg.threshold_max)
    kept = above_threshold(samples, threshold)
    metrics = rollout_metrics(groups) | improve(c, kept, state.rng, step)
    return metrics | {"rest/threshold": threshold, "rest/kept_fraction": len(kept) / len(samples),
                      "perf/step_s": time.perf_counter() - t0}


REST_STAGE: Stage[RestState] = Stage(budget=lambda config: config.rest.iterations, start=start_rest,
                                     step=rest_step, log_every_step=True)
"""`rest.iterations` Grow/Improve iterations."""
