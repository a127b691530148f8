"""The run's state, one record owned by `train`: where the schedule stands, the running stage's own state, and the
facts the summary needs. Every stage takes a `RunState` and returns it; `run_stage` (the step loop every stage
shares) hands it to `save` after every step, so any stage can resume in its middle.

A stage is a `Stage` record: `start` builds its state (fresh, or from a saved `state_dict`), `step` runs one
step, `finish` does what its end needs. The stage state (`StageState`) is the stage's to mutate; the records
around it (`RunState`, `ScheduleState`, `RunInfo`) are frozen and replaced.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from agentgrad.config import Config
from agentgrad.data.store import TrajectoryStore
from agentgrad.logging import RunLogger
from agentgrad.pipelines.components import Components


@dataclass(frozen=True)
class StageSwitch:
    from_stage: int
    to_stage: int
    algo: str
    """Algorithm of the stage that ended."""
    at_step: int
    """Global step number at which it ended."""
    stage_steps: int
    by_condition: bool
    """True when the switch condition fired; False when the stage used up its steps (or its own rule ended it)."""
    to_algo: str | None = None
    """Algorithm run after the switch (None after the last stage)."""
    reason: str = ""
    """Why, in words: which threshold fired on which measured values, or the step budget."""
    values: Mapping[str, float] = field(default_factory=dict)
    """The measured values the decision read (rolling means, the critic's explained variance at the switch)."""

    @property
    def within_stage(self) -> bool:
        """An adaptive stage changed algorithm (from_stage == to_stage); the stage goes on."""
        return self.from_stage == self.to_stage


@dataclass(frozen=True)
class ScheduleState:
    """Where the schedule stands: small and JSON-serialisable (`to_dict`/`from_dict`)."""

    stage_index: int = 0
    """Stage being run (== number of stages when the schedule finished)."""
    stage_step: int = 0
    """Steps done in the current stage."""
    global_step: int = 0
    """Steps of the finished rollout stages (RL, ReST, DPO; BC draws no tasks per step): the next stage's
    task and sampling seeds start there, so no stage replays another's tasks."""
    window: tuple[float, ...] = ()
    """Recent values of the current stage's until_metric (the rolling window)."""
    switches: tuple[StageSwitch, ...] = ()
    stopped: bool = False
    """The current stage takes no more steps: its switch condition fired or its own rule (BC's) ended it."""
    by_condition: bool = False
    """It was the switch condition."""
    algo: str | None = None
    """Algorithm an adaptive stage runs now (the schedule picks it; None for single-algorithm stages)."""
    signals: tuple[tuple[float, float, float | None], ...] = ()
    """An adaptive stage's rolling window of (success, zero-signal fraction, critic explained variance or None),
    restarted at each switch."""

    def first_step(self, numbered: bool) -> int:
        """Number of the current stage's first step: rollout stages count on from `global_step`, BC from 0."""
        return self.global_step if numbered else 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ScheduleState:
        return cls(stage_index=int(d["stage_index"]), stage_step=int(d["stage_step"]),
                   global_step=int(d["global_step"]), window=tuple(float(x) for x in d["window"]),
                   switches=tuple(StageSwitch(**s) for s in d["switches"]), stopped=bool(d.get("stopped", False)),
                   by_condition=bool(d.get("by_condition", False)), algo=d.get("algo"),
                   signals=tuple((float(s), float(z), None if ev is None else float(ev))
                                 for s, z, ev in d.get("signals", ())))


@dataclass(frozen=True)
class RunInfo:
    """JSON-able facts the summary reports at the end."""

    evals: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Held-out evaluations by tag (bc, final)."""
    steps_by_algo: Mapping[str, int] = field(default_factory=dict)

    def with_eval(self, tag: str, result: Mapping[str, Any]) -> RunInfo:
        return dataclasses.replace(self, evals={**self.evals, tag: dict(result)})

    def with_steps(self, algo: str, steps: int) -> RunInfo:
        return dataclasses.replace(self, steps_by_algo={**self.steps_by_algo,
                                                        algo: self.steps_by_algo.get(algo, 0) + steps})

    def to_dict(self) -> dict[str, Any]:
        return {"evals": dict(self.evals), "steps_by_algo": dict(self.steps_by_algo)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunInfo:
        return cls(evals=dict(d.get("evals", {})), steps_by_algo=dict(d.get("steps_by_algo", {})))


class StageState(Protocol):
    """What a stage keeps across its steps besides the policy (RL: reference, KL controller, critic, replay...;
    BC: its demos' sampler and stop rule). `state_dict` holds all of it that a resumed run needs."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, saved: Mapping[str, Any]) -> None: ...


S = TypeVar("S", bound=StageState)


@dataclass(frozen=True)
class RunState:
    schedule: ScheduleState = ScheduleState()
    stage: StageState | None = None
    """The running stage's own state; None between stages."""
    info: RunInfo = RunInfo()


def never(state: Any) -> bool:
    return False


@dataclass(frozen=True)
class Stage(Generic[S]):
    """One algorithm as the schedule runs it. Every stage has these signatures (registry `schedule.STAGES`)."""

    budget: Callable[[Config], int]
    """The stage's steps (bc.steps, algo.steps, rest.iterations, dpo.iterations)."""
    start: Callable[[Components, RunLogger, int, Mapping[str, Any] | None], S]
    """(c, logger, number of the stage's first step, a saved state_dict or None) -> its state. A resumed
    stage (saved) announces nothing: it did when it first started."""
    step: Callable[[Components, RunLogger, TrajectoryStore | None, S, int], Mapping[str, float]]
    """(c, logger, store, state, step number) -> the step's metrics."""
    finish: Callable[[Components, RunLogger, S, ScheduleState], None] = lambda c, logger, state, position: None
    stops: Callable[[S], bool] = never
    """The stage's own rule says stop after this step (BC's stop rule)."""
    numbered: bool = True
    """Its steps draw tasks, numbered on the run's step counter (`ScheduleState.global_step`); BC's do not."""
    log_every_step: bool = False
    """Log every step whatever run.log_every (ReST and DPO always have)."""
    warns_slow_steps: bool = False
    """Warn once when a step takes over run.slow_step_warn_s (the advice is the online RL knobs')."""
    select_algo: Callable[[S, str], None] | None = None
    """A stage that runs whichever algorithm the schedule picked (adaptive) is told it before every step
    (`ScheduleState.algo`), so a resumed run picks it up from the schedule alone."""


Advance = Callable[[ScheduleState, Mapping[str, float], bool], ScheduleState]
"""(position, the step's metrics, the stage's own rule says stop) -> the position after the step."""
Save = Callable[[Components, RunState, int], None]
"""(c, run state, the number of the step just done) -> None: called by `run_stage` after every step and by
`run_schedule` at every stage end (then `run.stage` is None and the number is the global step); it decides
itself whether a checkpoint is due (`resume.RunCheckpointer`)."""


def no_save(c: Components, run: RunState, step: int) -> None:
    pass


def run_stage(name: str, stage: Stage, c: Components, logger: RunLogger, run: RunState, *,
              store: TrajectoryStore | None, advance: Advance, save: Save = no_save) -> RunState:
    """The loop every stage shares: steps from where `run` stands to the stage's end (its budget, or `stopped`),
    numbered from the stage's first step; metrics logged every run.log_every steps (and on the last or
    stopping step); `save` after every step; then the stage's `finish`."""
    total = stage.budget(c.config)
    first = run.schedule.first_step(stage.numbered)
    log_every = 1 if stage.log_every_step else c.config.run.log_every
    warn_s = c.config.run.slow_step_warn_s if stage.warns_slow_steps else None
    no_signal = NoSignalWatch()
    logger.display.start(name, first + total)
    try:
        while not run.schedule.stopped and run.schedule.stage_step < total:
            step = first + run.schedule.stage_step
            if stage.select_algo is not None and run.schedule.algo is not None:
                stage.select_algo(run.stage, run.schedule.algo)
            metrics = stage.step(c, logger, store, run.stage, step)
            if warn_s is not None and metrics.get("perf/step_s", 0.0) > warn_s:
                logger.display.print(slow_step_warning(name, step + 1, metrics["perf/step_s"], warn_s))
                warn_s = None  # once per stage: the user has been told
            if line := no_signal.update(name, step + 1, metrics):
                logger.display.print(line)
            position = advance(run.schedule, metrics, stage.stops(run.stage))
            if position.stopped or (step + 1) % log_every == 0 or position.stage_step == total:
                logger.log(step + 1, name, metrics)
            run = dataclasses.replace(run, schedule=position)
            save(c, run, step + 1)
    finally:
        logger.display.stop()
    stage.finish(c, logger, run.stage, run.schedule)
    return run


def slow_step_warning(stage: str, step: int, seconds: float, limit: float) -> str:
    return (f"warning: {stage} step {step} took {seconds:.0f} s (run.slow_step_warn_s={limit:g}); the defaults are "
            f"sized for short two-turn episodes: for longer ones lower algo.tasks_per_step, algo.group_size or "
            f"algo.epochs_per_step, or the rollout limits (docs/your-own-env.md)")


SUCCESS = "rollout/success_rate"
ZERO_SIGNAL = "rollout/zero_signal_groups"
"""Rollout signals as `rl.rollout_metrics` logs them (read here and by the adaptive schedule)."""


class NoSignalWatch:
    """Warns once when a stage's recent rollouts were nearly all failures, so nearly every group scored alike and
    group-relative advantages (and DPO's pairs, ReST's kept samples) were empty: the run burns steps without
    learning. Measured (docs/algorithms.md, "From a start below 10%"): from a 4% start at temperature 0.7, 97% of
    groups had no signal and GRPO stayed at 4-6%; at 0.3 every run converged. Reads the rollout metrics, so it
    applies to any stage that reports them."""

    def __init__(self, window: int = 10, max_success: float = 0.05, min_zero_signal: float = 0.9) -> None:
        self.window, self.max_success, self.min_zero_signal = window, max_success, min_zero_signal
        self.recent: deque[tuple[float, float]] = deque(maxlen=window)
        self.warned = False

    def update(self, stage: str, step: int, metrics: Mapping[str, float]) -> str | None:
        """The warning line the first time the last `window` steps qualify, else None."""
        success, zero = metrics.get(SUCCESS), metrics.get(ZERO_SIGNAL)
        if self.warned or success is None or zero is None:
            return None
        self.recent.append((success, zero))
        if len(self.recent) < self.window:
            return None
        success = statistics.fmean(s for s, _ in self.recent)
        zero = statistics.fmean(z for _, z in self.recent)
        if success > self.max_success or zero < self.min_zero_signal:
            return None
        self.warned = True
        return (f"warning: {stage} steps {step - self.window + 1}-{step}: rollout success {success:.1%} and "
                f"{zero:.0%} of groups with no signal (every sample scored alike), so these steps teach almost "
                f"nothing; from a start this weak lower rollout.temperature (0.3 converged where 0.7 did not: "
                f"docs/algorithms.md), add process rewards (docs/rewards.md) or train BC longer")


StepHook = Callable[[int, Mapping[str, float]], bool]
"""(step number, the step's metrics) -> True to end the stage after this step."""


def run_alone(name: str, stage: Stage[S], c: Components, logger: RunLogger, store: TrajectoryStore | None = None, *,
              on_step: StepHook | None = None, first_step: int = 0, state: S | None = None) -> int:
    """Run one stage by itself (no schedule, no checkpoints), from a fresh state or `state`, its steps numbered
    from `first_step`; `on_step(step, metrics)` may end it early. Returns the steps taken."""
    if stage.budget(c.config) == 0:
        return 0
    position = ScheduleState(global_step=first_step)
    if state is None:
        state = stage.start(c, logger, position.first_step(stage.numbered), None)
    run = RunState(position, state)

    def advance(p: ScheduleState, metrics: Mapping[str, float], stop: bool) -> ScheduleState:
        fired = on_step is not None and on_step(p.first_step(stage.numbered) + p.stage_step + 1, metrics)
        return dataclasses.replace(p, stage_step=p.stage_step + 1, stopped=fired or stop, by_condition=fired)

    return run_stage(name, stage, c, logger, run, store=store, advance=advance).schedule.stage_step
