"""Stage schedules: a list of stages, each an algorithm run until its step budget or a switch condition on a
measured metric (e.g. bc, then grpo until the rolling `rollout/success_rate` reaches 0.15, then ppo).

Every stage is run through `STAGES` with one signature; stage changes are logged (stage "schedule") and the
`ScheduleState` record, small and JSON-serialisable, is written after every step so a resumed run can
continue the same stage where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from agentgrad.config import Config, StageConfig
from agentgrad.data.store import TrajectoryStore
from agentgrad.logging import RunLogger
from agentgrad.pipelines.bc import run_bc
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.dpo import run_dpo
from agentgrad.pipelines.rest import run_rest
from agentgrad.pipelines.rl import ONLINE_ALGORITHMS, StepHook, run_rl
from agentgrad.registry import Registry

StageRunner = Callable[[Components, RunLogger, "TrajectoryStore | None", "StepHook | None", int], int]
"""(components, logger, store, on_step, first_step) -> steps taken."""

STAGES: Registry[StageRunner] = Registry("stage algorithm")


def _online(c: Components, logger: RunLogger, store: TrajectoryStore | None, on_step: StepHook | None,
            first_step: int) -> int:
    return run_rl(c, logger, store, on_step=on_step, first_step=first_step)


def _bc(c: Components, logger: RunLogger, store: TrajectoryStore | None, on_step: StepHook | None,
        first_step: int) -> int:
    return run_bc(c, logger, on_step=on_step)


def _rest(c: Components, logger: RunLogger, store: TrajectoryStore | None, on_step: StepHook | None,
          first_step: int) -> int:
    return run_rest(c, logger, store, on_step=on_step, first_step=first_step)


def _dpo(c: Components, logger: RunLogger, store: TrajectoryStore | None, on_step: StepHook | None,
         first_step: int) -> int:
    return run_dpo(c, logger, store, on_step=on_step, first_step=first_step)


for _name in ONLINE_ALGORITHMS:
    STAGES.add(_name, _online)
STAGES.add("bc", _bc)
STAGES.add("rest", _rest)
STAGES.add("dpo", _dpo)


# ---- the state a resume needs -------------------------------------------------------------------------------


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
    """True when the switch condition fired; False when the stage used up its steps."""


@dataclass(frozen=True)
class ScheduleState:
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ScheduleState":
        return cls(stage_index=int(d["stage_index"]), stage_step=int(d["stage_step"]),
                   global_step=int(d["global_step"]), window=tuple(float(x) for x in d["window"]),
                   switches=tuple(StageSwitch(**s) for s in d["switches"]))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)  # atomic: a crash never leaves half a state file

    @classmethod
    def load(cls, path: str | Path) -> "ScheduleState":
        return cls.from_dict(json.loads(Path(path).read_text()))


def should_switch(window: Sequence[float], threshold: float, window_steps: int) -> bool:
    """True once `window_steps` values were measured and the mean of the last `window_steps` reaches
    `threshold`. Requiring a full window keeps one lucky batch from ending a stage."""
    if len(window) < window_steps:
        return False
    recent = window[-window_steps:]
    return sum(recent) / window_steps >= threshold


# ---- stages -------------------------------------------------------------------------------------------------


def stages_of(config: Config) -> tuple[StageConfig, ...]:
    """`schedule.stages`, or the default run: bc, then `algo.name` for its configured steps."""
    if config.schedule.stages:
        return tuple(config.schedule.stages)
    stages = [StageConfig(algo="bc", steps=config.bc.steps)]
    steps = {"rest": config.rest.iterations, "dpo": config.dpo.iterations}.get(config.algo.name, config.algo.steps)
    if config.algo.name != "bc":
        stages.append(StageConfig(algo=config.algo.name, steps=steps))
    return tuple(stages)


def stage_config(config: Config, stage: StageConfig, remaining_steps: int | None = None) -> Config:
    """The run config as one stage sees it: its algorithm, its step budget and its algo overrides."""
    steps = stage.steps if remaining_steps is None else remaining_steps
    tree = config.to_dict()
    tree["algo"] |= {**stage.algo_overrides, "name": stage.algo}
    if stage.algo == "bc":
        tree["bc"]["steps"] = steps
    elif stage.algo == "rest":
        tree["rest"]["iterations"] = steps
    elif stage.algo == "dpo":
        tree["dpo"]["iterations"] = steps
    else:
        tree["algo"]["steps"] = steps
    return Config.model_validate(tree)


StageEnd = Callable[[int, StageConfig, int], None]
"""(stage index, stage, steps it took) -> None: e.g. checkpoint after BC."""


def run_schedule(c: Components, logger: RunLogger, stages: Sequence[StageConfig], *,
                 store: TrajectoryStore | None = None, state: ScheduleState | None = None,
                 state_path: str | Path | None = None, on_stage_end: StageEnd | None = None) -> ScheduleState:
    """Run `stages` in order from `state` (a fresh schedule by default, or one loaded to resume)."""
    state = state or ScheduleState()
    while state.stage_index < len(stages):
        index = state.stage_index
        stage = stages[index]
        sc = dataclasses.replace(c, config=stage_config(c.config, stage, stage.steps - state.stage_step))
        fired = False

        def on_step(step: int, metrics: Mapping[str, float]) -> bool:
            nonlocal state, fired
            window = state.window
            if stage.until_metric is not None and metrics.get(stage.until_metric) is not None:
                window = (*window, float(metrics[stage.until_metric]))[-stage.window_steps:]
            state = dataclasses.replace(state, stage_step=state.stage_step + 1, window=window)
            if state_path is not None:
                state.save(state_path)
            fired = stage.until_metric is not None and should_switch(window, stage.until_value, stage.window_steps)
            return fired

        first_step = state.global_step + state.stage_step
        if stage.steps > state.stage_step:
            STAGES.get(stage.algo)(sc, logger, store, on_step, first_step)
        taken = state.stage_step  # every runner calls on_step once per step
        global_step = state.global_step + (0 if stage.algo == "bc" else taken)
        switch = StageSwitch(index, index + 1, stage.algo, global_step, taken, fired)
        state = ScheduleState(stage_index=index + 1, stage_step=0, global_step=global_step,
                              switches=(*state.switches, switch))
        if state_path is not None:
            state.save(state_path)
        logger.log(state.global_step, "schedule", {
            "schedule/from_stage": float(index), "schedule/to_stage": float(index + 1),
            "schedule/stage_steps": float(taken), "schedule/by_condition": float(fired)})
        logger.display.print(f"stage {index} ({stage.algo}) ended after {taken} steps"
                             + (f": rolling {stage.until_metric} reached {stage.until_value}" if fired else ""))
        if on_stage_end is not None:
            on_stage_end(index, stage, taken)
    return state
