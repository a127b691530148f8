"""Fault accounting for RL steps: tool faults mask their samples, non-finite losses skip their update.

Metric keys (per step): `faults/tool_timeouts`, `faults/tool_crashes` (tool calls), `faults/tool_fault_samples`
(samples masked for them), `faults/reward_failures` (samples the reward function masked), `faults/nonfinite_losses`
(updates skipped), `faults/nonfinite_grads` (updates the learner skipped for non-finite gradients).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from agentgrad.faults import NonFiniteLossError
from agentgrad.rewards.base import masked
from agentgrad.types import ScoredTrajectory, TrajectoryGroup

INFRA_TOOL_ERRORS = {"timeout": "faults/tool_timeouts", "crashed": "faults/tool_crashes"}
"""Tool errors that are the infrastructure's fault, not the policy's (unlike bad_arguments or not_found)."""


def mask_tool_faults(groups: Sequence[TrajectoryGroup], *, enabled: bool = True
                     ) -> tuple[list[TrajectoryGroup], dict[str, float]]:
    """Mask every sample in which a tool timed out or crashed (its outcome says nothing about the policy), and
    count the faults. Samples already masked by the reward function are counted as reward failures."""
    counts: Counter = Counter({k: 0.0 for k in (*INFRA_TOOL_ERRORS.values(), "faults/tool_fault_samples",
                                                "faults/reward_failures")})
    out = []
    for g in groups:
        samples = []
        for s in g.samples:
            kinds = [t.tool_error for t in s.trajectory.turns if t.tool_error in INFRA_TOOL_ERRORS]
            counts.update(INFRA_TOOL_ERRORS[k] for k in kinds)
            if s.reward.masked:
                counts["faults/reward_failures"] += 1
            elif kinds and enabled:
                s = ScoredTrajectory(s.trajectory, masked(f"tool fault: {kinds[0]}"), s.success)
                counts["faults/tool_fault_samples"] += 1
            samples.append(s)
        out.append(dataclasses.replace(g, samples=tuple(samples)))
    return out, {k: float(v) for k, v in counts.items()}


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
