"""ReST: Grow, then Improve, repeated. By default ReST-EM (Singh et al. 2023, "Beyond Human Data").

Grow: sample `samples_per_task` trajectories per task with the current policy. Improve: keep the trajectories
whose reward reaches a threshold (`data.filters.rest_threshold`; with 0/1 rewards: the successes), at most
`max_per_task` per task and no duplicates, and fine-tune on them with the SFT loss.

`rest.improve_from` says which weights Improve fine-tunes. ReST-EM ('start') re-fits the policy the stage began
with, optimizer state reset, on the latest Grow's samples: each iteration is one EM step, a new fit to the
samples of the better policy, so one iteration's overfitting does not carry into the next. Gulcehre et al.'s
ReST ('current') keeps fine-tuning the policy, each Improve step on top of the last, with a threshold that rises
per iteration; that rise is what makes it differ from expert iteration, and only a graded reward gives it
anything to do.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentgrad.algos.losses import sft_loss
from agentgrad.data.filters import above_threshold, per_task_cap, rest_threshold
from agentgrad.data.store import TrajectoryStore
from agentgrad.faults import kill_point
from agentgrad.logging import RunLogger
from agentgrad.pipelines.bc import bc_demos
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.rl import rl_tasks, rollout_groups, rollout_metrics
from agentgrad.pipelines.run_state import Stage
from agentgrad.types import ScoredTrajectory, Trajectory, TrajectoryGroup


def grow(c: Components, step: int) -> list[TrajectoryGroup]:
    cfg = c.config.rest
    tasks = rl_tasks(c, step, n=cfg.tasks_per_iteration)
    return rollout_groups(c, tasks, step, group_size=cfg.samples_per_task)


def improve(c: Components, kept: Sequence[ScoredTrajectory], rng: random.Random, step: int = 0,
            start: Mapping[str, torch.Tensor] | None = None, demos: Sequence[Trajectory] = ()) -> dict[str, float]:
    """`sft_steps` SFT steps on minibatches drawn from the kept trajectories (and `rest.demo_fraction` of each
    from `demos`); from the `start` weights with a fresh optimizer state when given (ReST-EM), else from the
    current ones."""
    cfg = c.config.rest
    if start is not None:
        restore_start(c, start)
    if not kept or cfg.sft_steps == 0:
        return {"train/updates": 0.0}
    c.learner.set_lr(cfg.lr)
    losses = []
    for _ in range(cfg.sft_steps):
        n_demos = round(cfg.demo_fraction * cfg.batch_size_episodes) if demos else 0
        picked = [*rng.sample(list(kept), min(cfg.batch_size_episodes - n_demos, len(kept))),
                  *rng.sample(list(demos), min(n_demos, len(demos)))]
        batch = c.collate(picked)
        loss = sft_loss(c.learner.logprobs(batch), batch.loss_mask)
        c.learner.step(loss)
        kill_point("update", step)
        losses.append(loss.item())
    return {"loss/sft": sum(losses) / len(losses), "train/updates": float(cfg.sft_steps)}


def trainable_state(c: Components) -> dict[str, torch.Tensor]:
    """A copy of the weights the learner trains (the model's, and a factored head's under `head.`)."""
    state = {k: v.detach().clone() for k, v in c.loaded.model.state_dict().items()}
    if c.tool_head is not None:
        state |= {f"head.{k}": v.detach().clone() for k, v in c.tool_head.state_dict().items()}
    return state


def restore_start(c: Components, start: Mapping[str, torch.Tensor]) -> None:
    """Back to the `start` weights, with the optimizer's moments dropped: a fine-tune from scratch (the policy
    shares these tensors, so it samples from them too)."""
    c.loaded.model.load_state_dict({k: v for k, v in start.items() if not k.startswith("head.")})
    if c.tool_head is not None:
        c.tool_head.load_state_dict({k[5:]: v for k, v in start.items() if k.startswith("head.")})
    c.learner.optimizer.state.clear()


@dataclass
class RestState:
    first_step: int
    """Number of the stage's first iteration: the threshold rises with the iterations since."""
    rng: random.Random
    """Draws the Improve minibatches."""
    start: dict[str, torch.Tensor] | None = None
    """The weights the stage began with, which every Improve step re-fits (improve_from=start); None otherwise."""
    demos: list[Trajectory] = field(default_factory=list)
    """BC's demonstrations, mixed into Improve's minibatches (rest.demo_fraction > 0; rebuilt, not saved)."""

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "start": self.start}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.rng.setstate(saved["rng"])
        self.start = saved.get("start")


def start_rest(c: Components, logger: RunLogger, first_step: int, saved: Mapping[str, Any] | None) -> RestState:
    start = trainable_state(c) if c.config.rest.improve_from == "start" and saved is None else None
    demos = bc_demos(c, logger, announce=False) if c.config.rest.demo_fraction > 0 else []
    state = RestState(first_step, random.Random(c.config.run.seed + first_step), start, demos)
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
    passed = above_threshold(samples, threshold)
    kept = per_task_cap(groups, passed, max_per_task=cfg.max_per_task, dedup=cfg.dedup)
    kept_ids = {id(s) for s in kept}
    metrics = rollout_metrics(groups) | improve(c, kept, state.rng, step, state.start, state.demos)
    return metrics | {"rest/threshold": threshold, "rest/passed_fraction": len(passed) / len(samples),
                      "rest/kept_fraction": len(kept) / len(samples),
                      "rest/tasks_kept": float(len({id(g) for g in groups for s in g.samples if id(s) in kept_ids})),
                      "perf/step_s": time.perf_counter() - t0}


REST_STAGE: Stage[RestState] = Stage(budget=lambda config: config.rest.iterations, start=start_rest,
                                     step=rest_step, log_every_step=True)
"""`rest.iterations` Grow/Improve iterations."""
