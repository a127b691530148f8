"""The `adaptive` stage: GRPO (or another critic-free algorithm) while rolling success is low, PPO once it is
high, and back when it collapses, decided by a band (hysteresis) on two measured signals.

`decide` is the rule, a pure function: (the running algorithm, the window of measured (success, zero-signal
fraction)) -> a `Decision` (the next step's algorithm, which threshold fired, the reason in words). The schedule
(`schedule.advance`) calls it after every step, keeps the window and the running algorithm in `ScheduleState`
and records each switch; the stage itself (`ADAPTIVE_STAGE`) only runs the algorithm it is told
(`Stage.select_algo`). Its state is one `RLState` for the whole stage, with the critic built at the start: while
the low algorithm runs, the critic is fitted on its batches' Monte-Carlo returns (`rl.warm_critic`), so PPO takes
over with a trained value model instead of a zero head.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentgrad.config import AdaptiveConfig
from agentgrad.data.store import TrajectoryStore
from agentgrad.logging import RunLogger
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.rl import ONLINE_ALGORITHMS, RLState, rl_step, start_rl
from agentgrad.pipelines.run_state import Stage

HIGH_ALGO = "ppo"
"""The algorithm above the band: the only online algorithm with a critic."""
CRITIC_EV = "critic/explained_variance"
"""The critic's signal, as `rl.critic_metrics` logs it (the rollout signals are `run_state.SUCCESS`, `ZERO_SIGNAL`)."""


@dataclass(frozen=True)
class Decision:
    algo: str
    """The algorithm of the next step."""
    threshold: str | None
    """`up_at` or `down_at` when this decision switches algorithm; None when it stays."""
    reason: str
    success: float | None = None
    """Rolling mean success over the full window (None while the window is not full)."""
    zero_signal: float | None = None
    """Rolling mean zero-signal fraction over the full window."""
    critic_ev: float | None = None
    """Rolling mean of the critic's explained variance over the window's steps that measured one."""

    @property
    def switched(self) -> bool:
        return self.threshold is not None


Signals = tuple[float, float, "float | None"]
"""One step's (success, zero-signal fraction, the critic's explained variance or None when none was measured)."""


def decide(algo: str, window: Sequence[Signals], rule: AdaptiveConfig) -> Decision:
    """The next step's algorithm, from the running one and its window of signals.

    Below the band's top: `low_algo` runs; it hands over to ppo once, over the last `window_steps` steps, the
    mean success reaches `up_at`, the mean zero-signal fraction is at most `max_zero_signal` and (unless
    `min_critic_ev` is None) the critic's mean explained variance is above `min_critic_ev`. Above: ppo runs
    until mean success falls below `down_at`. Between `down_at` and `up_at` neither fires, so success wandering
    inside the band never flaps. Nothing fires before the window is full (one lucky batch decides nothing)."""
    if algo not in (rule.low_algo, HIGH_ALGO):
        raise ValueError(f"adaptive stage runs {rule.low_algo} or {HIGH_ALGO}, not {algo!r}")
    W = rule.window_steps
    if len(window) < W:
        return Decision(algo, None, f"{len(window)} of {W} steps measured")
    recent = window[-W:]
    success = sum(s[0] for s in recent) / W
    zero = sum(s[1] for s in recent) / W
    evs = [s[2] for s in recent if s[2] is not None]
    ev = sum(evs) / len(evs) if evs else None
    measured = (f"rolling success {success:.3f}, zero-signal {zero:.3f}"
                + (f", critic explained variance {ev:+.3f}" if ev is not None else "") + f" over {W} steps")
    if algo == rule.low_algo:
        critic_ready = rule.min_critic_ev is None or (ev is not None and ev > rule.min_critic_ev)
        if success >= rule.up_at and zero <= rule.max_zero_signal and critic_ready:
            return Decision(HIGH_ALGO, "up_at", f"{measured}: success >= up_at {rule.up_at:g}, zero-signal <= "
                            f"max_zero_signal {rule.max_zero_signal:g}"
                            + (f", critic > min_critic_ev {rule.min_critic_ev:g}" if rule.min_critic_ev is not None
                               else ""), success, zero, ev)
        why = ("success below up_at" if success < rule.up_at else
               f"zero-signal above max_zero_signal {rule.max_zero_signal:g}" if zero > rule.max_zero_signal else
               f"critic not above min_critic_ev {rule.min_critic_ev:g} yet")
        return Decision(algo, None, f"{measured}: {why}", success, zero, ev)
    if success < rule.down_at:
        return Decision(rule.low_algo, "down_at", f"{measured}: success < down_at {rule.down_at:g}", success, zero,
                        ev)
    return Decision(algo, None, f"{measured}: success not below down_at", success, zero, ev)


# ---- the stage ------------------------------------------------------------------------------------------------


def _start(c: Components, logger: RunLogger, first_step: int, saved: Mapping[str, Any] | None) -> RLState:
    rule = c.config.adaptive
    state = start_rl(c, saved, algorithm=ONLINE_ALGORITHMS.get(rule.low_algo), with_critic=True)
    state.warm_critic = rule.warm_critic
    c.learner.set_lr(c.config.algo.lr)
    return state


def _select(state: RLState, algo: str) -> None:
    state.algorithm = ONLINE_ALGORITHMS.get(algo)


def _step(c: Components, logger: RunLogger, store: TrajectoryStore | None, state: RLState, step: int
          ) -> Mapping[str, float]:
    return {**rl_step(c, step, state, store), "adaptive/high_algo": float(state.algorithm.uses_critic)}


ADAPTIVE_STAGE: Stage[RLState] = Stage(budget=lambda config: config.algo.steps, start=_start, step=_step,
                                       select_algo=_select, warns_slow_steps=True)
"""`algo.steps` online steps in all, each of the algorithm the schedule picked (`adaptive/high_algo`: 1 when
it was ppo)."""
