"""Behaviour cloning: SFT on expert trajectories, loss on the policy's own tokens only."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import Tensor

from agentgrad.algos.losses import sft_loss
from agentgrad.batch import TokenBatch, collate, collate_head
from agentgrad.logging import RunLogger
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.demos import DemoLimitError, check_demos_fit, expert_demos  # noqa: F401 (their old home)
from agentgrad.pipelines.evaluate import evaluate
from agentgrad.types import Trajectory


def bc_demos(c: Components, logger: RunLogger) -> list[Trajectory]:
    """What BC clones: the logged trajectories of bc.demos, or bc.num_demos episodes of the suite's expert."""
    cfg = c.config.bc
    if cfg.demos is None:
        return expert_demos(c, cfg.num_demos, seed=c.config.run.seed + 1, logger=logger)
    from agentgrad.pipelines.data import DemoLoadError, read_demos, suite_tools

    if c.tool_head is not None:
        raise DemoLoadError("bc.demos with rollout.action_head=factored is not supported (logs hold no head "
                            "decisions); use the suite's expert")
    log = read_demos(cfg.demos, c.codec, suite_tools(c.suite)[0])
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
    batch = collate(picked, pad_token_id=c.pad_token_id)
    if c.tool_head is None:
        token_loss, head = sft_loss(c.learner.logprobs(batch), batch.loss_mask), {}
        metrics = c.learner.step(token_loss)
    else:
        token_loss, head_loss = bc_losses_with_head(c, picked, batch)
        metrics = c.learner.step(token_loss + cfg.head_loss_coef * head_loss)
        head = {"loss/bc_head": head_loss.item()}
    return {"loss/bc": token_loss.item(), **head, "train/lr": lr, "perf/policy_tokens": float(batch.num_policy_tokens),
            **metrics}


def bc_losses_with_head(c: Components, picked: list[Trajectory], batch: TokenBatch) -> tuple[Tensor, Tensor]:
    """The LM's token loss (the head's names are not in it: loss_mask 0) and the head's NLL of the expert's
    tools, read from the same forward's hidden states at the call positions."""
    assert c.tool_head is not None
    decisions = collate_head(picked, c.tool_head.tool_names)
    logprobs, hidden = c.learner.logprobs_and_hidden(batch, decisions.row, decisions.position)  # (B, T), (D, H)
    head_loss = c.tool_head.bc_loss(hidden, decisions.legal, decisions.tool) if len(decisions.row) else hidden.sum()
    return sft_loss(logprobs, batch.loss_mask), head_loss


def validation_success(c: Components) -> float:
    """Greedy success on the suite's 'test' split: BC's early-stopping signal, disjoint from held-out eval."""
    cfg = c.config.bc
    return evaluate(c.policy, c.codec, c.suite, c.limits, c.sampler, num_tasks=cfg.eval_tasks,
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


def _warn_if_stalled(c: Components, logger: RunLogger, rule: StopRule, step: int, warned: bool) -> bool:
    """Say so at half the budget when BC is nowhere near its target, instead of only after the whole budget."""
    cfg = c.config.bc
    if warned or step < cfg.steps // 2 or rule.best >= rule.target / 4:
        return warned
    logger.display.print(f"warning: BC is at step {step} of {cfg.steps} and its validation success is still "
                         f"{max(rule.best, 0):.0%} (target {rule.target:.0%}): it may not leave its plateau "
                         f"within bc.steps (see docs/learning.md)")
    return True


def run_bc(c: Components, logger: RunLogger, *, demos: list[Trajectory] | None = None,
           on_step: Callable[[int, Mapping[str, float]], bool] | None = None) -> int:
    """Returns the number of BC steps taken (fewer than bc.steps when stop_at_success was reached, or when
    `on_step(step, metrics)`, a schedule's switch condition, returned True)."""
    cfg = c.config.bc
    if cfg.steps == 0:
        return 0
    demos = demos if demos is not None else bc_demos(c, logger)
    rng = random.Random(c.config.run.seed)
    rule = StopRule(cfg.stop_at_success, cfg.stop_window) if cfg.stop_at_success is not None else None
    warned = False
    logger.display.start("bc", cfg.steps)
    for step in range(cfg.steps):
        near = rule is not None and rule.best > 0  # the phase change has begun: check every step, slow down
        t0 = time.perf_counter()
        metrics = bc_step(c, demos, rng, step, lr_scale=cfg.lr_scale_near_target if near else 1.0)
        metrics["perf/tokens_per_s"] = metrics["perf/policy_tokens"] / (time.perf_counter() - t0)
        reached = False
        every = 1 if near else cfg.eval_every
        if rule is not None and (step + 1) % every == 0:
            metrics["eval/bc_validation_success"] = validation_success(c)
            reached = rule.observe(metrics["eval/bc_validation_success"], step + 1, c.loaded.model, cfg.keep_best)
            metrics["eval/bc_validation_smoothed"] = rule.smoothed
            warned = _warn_if_stalled(c, logger, rule, step + 1, warned)
        reached = (on_step is not None and on_step(step + 1, metrics)) or reached
        if reached or (step + 1) % c.config.run.log_every == 0 or step + 1 == cfg.steps:
            logger.log(step + 1, "bc", metrics)
        if reached:
            if "eval/bc_validation_success" in metrics:
                logger.display.print(f"BC stopped at step {step + 1}: validation success "
                                     f"{metrics['eval/bc_validation_smoothed']:.0%} (mean of the last "
                                     f"{min(cfg.stop_window, len(rule.checks))} checks)")
            logger.display.stop()
            return step + 1
    logger.display.stop()
    if rule is not None:
        # Not an error (RL may still work), but the run's premise failed: say so where the user looks.
        kept = ""
        if rule.best_state is not None and rule.best_step != cfg.steps:
            c.loaded.model.load_state_dict(rule.best_state)
            kept = f"; RL starts from its best check (step {rule.best_step}, {rule.best:.0%})"
        logger.display.print(f"warning: BC used all {cfg.steps} steps without reaching validation success "
                             f"{cfg.stop_at_success:.0%}{kept} (raise bc.steps, or see docs/learning.md on BC's "
                             f"plateau)")
    return cfg.steps
