"""Behaviour cloning: SFT on expert trajectories, loss on the policy's own tokens only."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from agentgrad.algos.losses import sft_loss
from agentgrad.batch import TokenBatch, collate_head
from agentgrad.data.store import TrajectoryStore
from agentgrad.faults import kill_point
from agentgrad.logging import RunLogger
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.demos import DemoLimitError, check_demos_fit, expert_demos  # noqa: F401 (their old home)
from agentgrad.pipelines.evaluate import evaluate
from agentgrad.pipelines.run_state import ScheduleState, Stage, StepHook, run_alone
from agentgrad.types import Trajectory


def bc_demos(c: Components, logger: RunLogger, *, announce: bool = True) -> list[Trajectory]:
    """What BC clones: the logged trajectories of bc.demos, or bc.num_demos episodes of the suite's expert.
    `announce`: log their counts (a resumed BC stage did when it started)."""
    cfg = c.config.bc
    if cfg.demos is None:
        return expert_demos(c, cfg.num_demos, seed=c.config.run.seed + 1, logger=logger if announce else None,
                            display=logger.display)
    from agentgrad.pipelines.data import DemoLoadError, read_demos, suite_tools

    if c.tool_head is not None:
        raise DemoLoadError(f"bc.demos with rollout.action_head={c.sampler.action_head} is not supported (logs "
                            "hold no head decisions); use the suite's expert")
    log = read_demos(cfg.demos, c.codec, suite_tools(c.suite)[0])
    if announce:
        logger.display.print(log.summary(cfg.demos))
        logger.log(0, "bc_demos", log.metrics())
    return list(check_demos_fit(list(log.demos), c.limits).kept)


def bc_lr(step: int, *, peak: float, warmup: int, total: int, schedule: str, floor: float = 0.1) -> float:
    """Linear warm-up to `peak`, then constant or cosine decay to `floor * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def bc_step(c: Components, demos: list[Trajectory], rng: random.Random, step: int,
            lr_scale: float = 1.0) -> dict[str, float]:
    cfg = c.config.bc
    lr = lr_scale * bc_lr(step, peak=cfg.lr, warmup=cfg.warmup_steps, total=cfg.steps, schedule=cfg.lr_schedule)
    c.learner.set_lr(lr)
    picked = rng.sample(demos, min(cfg.batch_size_episodes, len(demos)))
    batch = c.collate(picked)
    if c.tool_head is None:
        token_loss, head = sft_loss(c.learner.logprobs(one_group(batch) if cfg.shared_prefix else batch),
                                    batch.loss_mask), {}
        metrics = c.learner.step(token_loss)
    else:
        token_loss, head_loss = bc_losses_with_head(c, picked, batch)
        metrics = c.learner.step(token_loss + cfg.head_loss_coef * head_loss)
        head = {"loss/bc_head": head_loss.item()}
    kill_point("update", step)
    return {"loss/bc": token_loss.item(), **head, "train/lr": lr, "perf/policy_tokens": float(batch.num_policy_tokens),
            **metrics}


def one_group(batch: TokenBatch) -> TokenBatch:
    """The batch as one group, so that the learner runs the prefix its demos share once (bc.shared_prefix): BC's
    demos all open with the same system prompt and tool list (~38 tokens in the default run)."""
    return batch.replace(group_index=torch.zeros_like(batch.group_index))


def bc_losses_with_head(c: Components, picked: list[Trajectory], batch: TokenBatch) -> tuple[Tensor, Tensor]:
    """The LM's token loss (the head's names are not in it: loss_mask 0) and the head's NLL of the expert's
    tools, read from the same forward's hidden states at the call positions."""
    assert c.tool_head is not None
    decisions = collate_head(picked, c.tool_head.choices).to(c.device)
    shared = one_group(batch) if c.config.bc.shared_prefix else batch
    logprobs, hidden = c.learner.logprobs_and_hidden(shared)  # (B, T), (B, T, H)
    head_loss = (c.tool_head.bc_loss(hidden, decisions.row, decisions.position, decisions.legal, decisions.choice)
                 if len(decisions.row) else logprobs.new_zeros(()))
    return sft_loss(logprobs, batch.loss_mask), head_loss


def validation_success(c: Components, num_tasks: int | None = None) -> float:
    """Greedy success on the suite's 'test' split: BC's early-stopping signal, disjoint from held-out eval.
    `num_tasks`: default bc.eval_tasks."""
    cfg = c.config.bc
    return evaluate(c.policy, c.codec, c.suite, c.limits, c.sampler, num_tasks=num_tasks or cfg.eval_tasks,
                    seed=c.config.run.seed, split="test", batch_size=c.config.eval.batch_size).success_rate


@dataclass
class StopRule:
    """BC's stopping rule. BC on a tiny model crosses a sharp phase change (0% -> 80% validation success within
    ~10 steps), so one check of a few dozen tasks is a noisy place to decide where RL starts: the rule stops on
    the mean of the last `window` checks, and remembers the weights of the best such mean so that a BC that
    never reaches `target` hands on its best policy rather than its last."""

    target: float
    window: int
    checks: list[float] = field(default_factory=list)
    best: float = -1.0
    best_step: int = 0
    best_state: dict[str, Tensor] | None = None

    @property
    def smoothed(self) -> float:
        recent = self.checks[-self.window:]
        return sum(recent) / len(recent)

    def observe(self, success: float, step: int, model: torch.nn.Module, keep_best: bool) -> bool:
        """Record a check; True when BC should stop."""
        self.checks.append(success)
        stop = len(self.checks) >= self.window and self.smoothed >= self.target
        if self.smoothed > self.best:
            self.best, self.best_step = self.smoothed, step
            if keep_best and not stop:  # a stopping BC hands on its current weights: no copy needed
                self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        return stop


    def state_dict(self) -> dict[str, Any]:
        return {"checks": list(self.checks), "best": self.best, "best_step": self.best_step,
                "best_state": self.best_state}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.checks = list(saved["checks"])
        self.best, self.best_step, self.best_state = saved["best"], saved["best_step"], saved["best_state"]


def _warn_if_stalled(c: Components, logger: RunLogger, rule: StopRule, step: int, warned: bool) -> bool:
    """Say so at half the budget when BC is nowhere near its target, instead of only after the whole budget."""
    cfg = c.config.bc
    if warned or step < cfg.steps // 2 or rule.best >= rule.target / 4:
        return warned
    logger.display.print(f"warning: BC is at step {step} of {cfg.steps} and its validation success is still "
                         f"{max(rule.best, 0):.0%} (target {rule.target:.0%}): it may not leave its plateau "
                         f"within bc.steps (see docs/learning.md)")
    return True


@dataclass
class BCState:
    """What BC keeps across its steps: the demos (rebuilt, not saved: they follow from the config), the sampler
    of its minibatches, and the stop rule with its checks and best weights."""

    demos: list[Trajectory]
    rng: random.Random
    rule: StopRule | None
    warned: bool = False
    reached: bool = False
    """The stop rule said stop at the last check."""

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "rule": self.rule.state_dict() if self.rule is not None else None,
                "warned": self.warned, "reached": self.reached}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.rng.setstate(saved["rng"])
        if self.rule is not None:
            self.rule.load_state_dict(saved["rule"])
        self.warned, self.reached = saved["warned"], saved["reached"]


def start_bc(c: Components, logger: RunLogger, first_step: int = 0, saved: Mapping[str, Any] | None = None, *,
             demos: list[Trajectory] | None = None) -> BCState:
    cfg = c.config.bc
    demos = demos if demos is not None else bc_demos(c, logger, announce=saved is None)
    rule = StopRule(cfg.stop_at_success, cfg.stop_window) if cfg.stop_at_success is not None else None
    state = BCState(demos, random.Random(c.config.run.seed), rule)
    if saved is not None:
        state.load_state_dict(saved)
    return state


def bc_iteration(c: Components, logger: RunLogger, store: TrajectoryStore | None, state: BCState,
                 step: int) -> dict[str, float]:
    """One BC step, then (every bc.eval_every steps, or every bc.dense_eval_every steps once the phase change has
    begun: any success, or bc.dense_checks_from) a validation check for the stop rule."""
    cfg = c.config.bc
    rule = state.rule
    best = rule.best if rule is not None else 0.0
    near = best > 0  # the phase change has begun: slow down
    dense = near and best >= cfg.dense_checks_from
    t0 = time.perf_counter()
    metrics = bc_step(c, state.demos, state.rng, step, lr_scale=cfg.lr_scale_near_target if near else 1.0)
    metrics["perf/tokens_per_s"] = metrics["perf/policy_tokens"] / (time.perf_counter() - t0)
    if rule is not None and (step + 1) % (cfg.dense_eval_every if dense else cfg.eval_every) == 0:
        t0 = time.perf_counter()
        metrics["eval/bc_validation_success"] = checked_success(c, probe=not near)
        metrics["perf/validation_s"] = time.perf_counter() - t0
        state.reached = rule.observe(metrics["eval/bc_validation_success"], step + 1, c.loaded.model, cfg.keep_best)
        metrics["eval/bc_validation_smoothed"] = rule.smoothed
        state.warned = _warn_if_stalled(c, logger, rule, step + 1, state.warned)
    return metrics


def checked_success(c: Components, *, probe: bool) -> float:
    """A validation check. Before any check has seen a success (`probe`), with bc.probe_tasks set, a probe of
    that many tasks first: its zero stands for the check (a full one would most likely see zero too), and a
    probe that sees any success is replaced by a full check of bc.eval_tasks, so every success the stop rule
    averages comes from a full check."""
    cfg = c.config.bc
    if probe and cfg.probe_tasks is not None and cfg.probe_tasks < cfg.eval_tasks:
        if validation_success(c, cfg.probe_tasks) == 0:
            return 0.0
    return validation_success(c)


def finish_bc(c: Components, logger: RunLogger, state: BCState, position: ScheduleState) -> None:
    cfg = c.config.bc
    rule = state.rule
    if position.stopped:
        if rule is not None and rule.checks:
            logger.display.print(f"BC stopped at step {position.stage_step}: validation success {rule.smoothed:.0%} "
                                 f"(mean of the last {min(cfg.stop_window, len(rule.checks))} checks)")
        return
    if rule is not None:
        # Not an error (RL may still work), but the run's premise failed: say so where the user looks.
        kept = ""
        if rule.best_state is not None and rule.best_step != cfg.steps:
            c.loaded.model.load_state_dict(rule.best_state)
            load_into_learner = getattr(getattr(c, "learner", None), "load_weights", None)
            if load_into_learner is not None:  # a sharded learner trains its own copy of the weights
                load_into_learner(rule.best_state)
            kept = f"; RL starts from its best check (step {rule.best_step}, {rule.best:.0%})"
        logger.display.print(f"warning: BC used all {cfg.steps} steps without reaching validation success "
                             f"{cfg.stop_at_success:.0%}{kept} (raise bc.steps, or see docs/learning.md on BC's "
                             f"plateau)")


BC_STAGE: Stage[BCState] = Stage(budget=lambda config: config.bc.steps, start=start_bc, step=bc_iteration,
                                 finish=finish_bc, stops=lambda state: state.reached, numbered=False)


def run_bc(c: Components, logger: RunLogger, *, demos: list[Trajectory] | None = None,
           on_step: StepHook | None = None) -> int:
    """BC alone (no schedule, no checkpoints). Returns the number of BC steps taken (fewer than bc.steps when
    stop_at_success was reached, or when `on_step(step, metrics)` returned True)."""
    state = start_bc(c, logger, demos=demos) if c.config.bc.steps else None
    return run_alone("bc", BC_STAGE, c, logger, on_step=on_step, state=state)
