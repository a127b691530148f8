"""Fault accounting for RL steps: tool faults mask their samples, non-finite losses skip their update.

Metric keys (per step): `faults/tool_timeouts`, `faults/tool_crashes` (tool calls), `faults/tool_fault_samples`
(samples masked for them), `faults/reward_failures` (samples the reward function masked), `faults/nonfinite_losses`
(updates skipped), `faults/nonfinite_grads` (updates the learner skipped for non-finite gradients).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentgrad.faults import NonFiniteLossError
from agentgrad.rewards.base import masked
from agentgrad.types import ScoredTrajectory, TrajectoryGroup

INFRA_TOOL_ERRORS = {"timeout": "faults/tool_timeouts", "crashed": "faults/tool_crashes"}
"""Tool errors that are the infrastructure's fault, not the policy's (unlike bad_arguments or not_found)."""


def _tool_faults(sample: ScoredTrajectory) -> list[str]:
    return [t.tool_error for t in sample.trajectory.turns if t.tool_error in INFRA_TOOL_ERRORS]


def mask_tool_faults(groups: Sequence[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """Mask every sample in which a tool timed out or crashed: its outcome says nothing about the policy."""
    def fix(s: ScoredTrajectory) -> ScoredTrajectory:
        kinds = _tool_faults(s)
        return ScoredTrajectory(s.trajectory, masked(f"tool fault: {kinds[0]}"), s.success) \
            if kinds and not s.reward.masked else s
    return [dataclasses.replace(g, samples=tuple(fix(s) for s in g.samples)) for g in groups]


def fault_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """Tool faults (calls) and the samples masked for a tool fault or by a failing reward function."""
    counts: Counter = Counter(dict.fromkeys(
        (*INFRA_TOOL_ERRORS.values(), "faults/tool_fault_samples", "faults/reward_failures"), 0))
    for s in (s for g in groups for s in g.samples):
        counts.update(INFRA_TOOL_ERRORS[k] for k in _tool_faults(s))
        if s.reward.masked:
            tool = (s.reward.reason or "").startswith("tool fault")
            counts["faults/tool_fault_samples" if tool else "faults/reward_failures"] += 1
    return {k: float(v) for k, v in counts.items()}


@dataclass
class NonFiniteGuard:
    """Counts updates with a non-finite loss; raises after `limit` in a row (the count survives resume)."""

    limit: int
    consecutive: int = 0

    def check(self, loss: torch.Tensor) -> bool:
        """True if the loss is finite (go ahead); False to skip this update. Raises after `limit` in a row."""
        if bool(torch.isfinite(loss)):
            self.consecutive = 0
            return True
        self.consecutive += 1
        if self.consecutive >= self.limit:
            raise NonFiniteLossError(f"{self.consecutive} consecutive updates had a non-finite loss ({loss.item()}); "
                                     "stopping (faults.max_consecutive_nonfinite). Lower algo.lr, check rewards "
                                     "for extreme values, or resume from the last checkpoint.")
        return False
