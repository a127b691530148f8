"""Behaviour cloning: SFT on expert trajectories, loss on the policy's own tokens only."""

from __future__ import annotations

import math
import random
import time
from typing import Callable, Mapping

from torch import Tensor

from agentgrad.algos.losses import sft_loss
from agentgrad.batch import TokenBatch, collate, collate_head
from agentgrad.logging import RunLogger
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.demos import DemoLimitError, check_demos_fit, expert_demos  # noqa: F401 (their old home)
from agentgrad.pipelines.evaluate import evaluate
from agentgrad.types import Trajectory


def bc_lr(step: int, *, peak: float, warmup: int, total: int, schedule: str, floor: float = 0.1) -> float:
    """Linear warm-up to `peak`, then constant or cosine decay to `floor * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def bc_step(c: Components, demos: list[Trajectory], rng: random.Random, step: int) -> dict[str, float]:
    cfg = c.config.bc
    lr = bc_lr(step, peak=cfg.lr, warmup=cfg.warmup_steps, total=cfg.steps, schedule=cfg.lr_schedule)
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
    return evaluate(c.policy, c.codec, c.suite, c.limits, num_tasks=cfg.eval_tasks, seed=c.config.run.seed,
                    split="test", batch_size=c.config.eval.batch_size).success_rate


def run_bc(c: Components, logger: RunLogger, *, demos: list[Trajectory] | None = None,
           on_step: Callable[[int, Mapping[str, float]], bool] | None = None) -> int:
    """Returns the number of BC steps taken (fewer than bc.steps when stop_at_success was reached, or when
    `on_step(step, metrics)`, a schedule's switch condition, returned True)."""
    cfg = c.config.bc
    if cfg.steps == 0:
        return 0
    demos = demos if demos is not None else expert_demos(c, cfg.num_demos, seed=c.config.run.seed + 1, logger=logger)
    rng = random.Random(c.config.run.seed)
    logger.display.start("bc", cfg.steps)
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        metrics = bc_step(c, demos, rng, step)
        metrics["perf/tokens_per_s"] = metrics["perf/policy_tokens"] / (time.perf_counter() - t0)
        reached = False
        if cfg.stop_at_success is not None and (step + 1) % cfg.eval_every == 0:
            metrics["eval/bc_validation_success"] = validation_success(c)
            reached = metrics["eval/bc_validation_success"] >= cfg.stop_at_success
        reached = (on_step is not None and on_step(step + 1, metrics)) or reached
        if reached or (step + 1) % c.config.run.log_every == 0 or step + 1 == cfg.steps:
            logger.log(step + 1, "bc", metrics)
        if reached:
            if "eval/bc_validation_success" in metrics:
                logger.display.print(f"BC stopped at step {step + 1}: validation success "
                                     f"{metrics['eval/bc_validation_success']:.0%}")
            logger.display.stop()
            return step + 1
    logger.display.stop()
    if cfg.stop_at_success is not None:
        # Not an error (RL may still work), but the run's premise failed: say so where the user looks.
        logger.display.print(f"warning: BC used all {cfg.steps} steps without reaching validation success "
                             f"{cfg.stop_at_success:.0%}; RL starts from a weaker policy (raise bc.steps, or "
                             f"see docs/design-notes.md on BC's plateau)")
    return cfg.steps
