"""`reward_metrics`: what a batch of scored trajectories says about the reward, for the metric sinks."""

from __future__ import annotations

from collections.abc import Sequence

from agentgrad.rewards.process import repeated_call_turns
from agentgrad.types import ScoredTrajectory, StopReason

DEFAULT_DEAD_LOOP_K = 2


def mask_kind(reason: str | None) -> str:
    """Coarse class of a masking reason: timeout, non_finite, judge, or error."""
    r = (reason or "").lower()
    if "timeout" in r or "did not return within" in r:
        return "timeout"
    if "non-finite" in r or "nan" in r.split():
        return "non_finite"
    if "judge" in r or "verdict" in r:
        return "judge"
    return "error"


def reward_metrics(scored: Sequence[ScoredTrajectory], *, dead_loop_k: int = DEFAULT_DEAD_LOOP_K) -> dict[str, float]:
    """Reward statistics of one batch.

    Means are over unmasked samples (0.0 when there are none); `reward/masked` counts masked samples and
    `reward/masked/<kind>` splits them by cause (timeout, non_finite, judge, error). `reward/process_mean` is
    the mean per-episode sum of process rewards. `reward/dead_loop_penalties` counts the turns that repeat an
    identical call for the `dead_loop_k`-th time or more (as `ProcessReward` penalises them), over all samples;
    `reward/repeated_call_stops` counts episodes the loop ended for a repeated call.
    """
    n = len(scored)
    live = [s for s in scored if not s.reward.masked]
    m = len(live)
    out: dict[str, float] = {
        "reward/count": float(n),
        "reward/masked": float(n - m),
        "reward/masked_frac": (n - m) / n if n else 0.0,
        "reward/outcome_mean": sum(s.reward.outcome for s in live) / m if m else 0.0,
        "reward/process_mean": sum(sum(s.reward.process) for s in live) / m if m else 0.0,
        "reward/total_mean": sum(s.reward.total for s in live) / m if m else 0.0,
        "reward/success_rate": sum(s.success for s in scored) / n if n else 0.0,
        "reward/dead_loop_penalties": float(sum(len(repeated_call_turns(s.trajectory, dead_loop_k)) for s in scored)),
        "reward/repeated_call_stops": float(sum(s.trajectory.stop_reason == StopReason.REPEATED_CALL for s in scored)),
    }
    for kind in ("timeout", "non_finite", "judge", "error"):
        out[f"reward/masked/{kind}"] = 0.0
    for s in scored:
        if s.reward.masked:
            out[f"reward/masked/{mask_kind(s.reward.reason)}"] += 1.0
    return out
