"""Stage schedules: a list of stages, each an algorithm run until its step budget or a switch condition on a
measured metric (e.g. bc, then grpo until the rolling `rollout/success_rate` reaches 0.15, then ppo). An
`adaptive` stage switches algorithm inside itself, both ways, by the band rule `adaptive.decide`.

Every stage is a `run_state.Stage` in `STAGES` (one signature); `run_schedule` takes the run's `RunState`, runs
each stage through the shared step loop from where the state stands (a resumed run continues the same stage
at the same step) and returns it. Stage changes are logged (stage "schedule").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from agentgrad.config import AdaptiveConfig, Config, StageConfig
from agentgrad.data.store import TrajectoryStore
from agentgrad.logging import RunLogger
from agentgrad.pipelines.adaptive import ADAPTIVE_STAGE, CRITIC_EV, HIGH_ALGO, decide
from agentgrad.pipelines.bc import BC_STAGE
from agentgrad.pipelines.components import Components
from agentgrad.pipelines.dpo import DPO_STAGE
from agentgrad.pipelines.mcts import MCTS_STAGE
from agentgrad.pipelines.rest import REST_STAGE
from agentgrad.pipelines.rl import ONLINE_ALGORITHMS, ONLINE_STAGE
from agentgrad.pipelines.run_state import (
    SUCCESS,
    ZERO_SIGNAL,
    RunState,
    Save,
    ScheduleState,
    Stage,
    StageState,
    StageSwitch,
    no_save,
    run_stage,
)
from agentgrad.registry import Registry

STAGES: Registry[Stage] = Registry("stage algorithm")
for _name in ONLINE_ALGORITHMS:
    STAGES.add(_name, ONLINE_STAGE)
STAGES.add("adaptive", ADAPTIVE_STAGE)
STAGES.add("bc", BC_STAGE)
STAGES.add("rest", REST_STAGE)
STAGES.add("dpo", DPO_STAGE)
STAGES.add("mcts", MCTS_STAGE)


def should_switch(window: Sequence[float], threshold: float, window_steps: int) -> bool:
    """True once `window_steps` values were measured and the mean of the last `window_steps` reaches
    `threshold`. Requiring a full window keeps one lucky batch from ending a stage."""
    if len(window) < window_steps:
        return False
    recent = window[-window_steps:]
    return sum(recent) / window_steps >= threshold


def advance(position: ScheduleState, stage: StageConfig, metrics: Mapping[str, float], stop: bool,
            rule: AdaptiveConfig | None = None) -> ScheduleState:
    """The position after one more step of `stage`: its rolling window of until_metric, and whether it ends; for
    an adaptive stage (`rule`), also its window of signals and the algorithm of its next step."""
    window = position.window
    if stage.until_metric is not None and metrics.get(stage.until_metric) is not None:
        window = (*window, float(metrics[stage.until_metric]))[-stage.window_steps:]
    fired = stage.until_metric is not None and should_switch(window, stage.until_value, stage.window_steps)
    position = dataclasses.replace(position, stage_step=position.stage_step + 1, window=window,
                                   stopped=fired or stop, by_condition=fired)
    return switch_algo(position, rule, metrics) if rule is not None else position


def switch_algo(position: ScheduleState, rule: AdaptiveConfig, metrics: Mapping[str, float]) -> ScheduleState:
    """An adaptive stage after a step (`position.stage_step` already counts it): the step's (success,
    zero-signal, critic explained variance) joins the window, `decide` picks the next algorithm, and a switch is
    recorded with its reason and the values it read (the window then restarts)."""
    algo = position.algo or rule.low_algo
    signals = position.signals
    ev = metrics.get(CRITIC_EV)
    ev = float(ev) if ev is not None and math.isfinite(ev) else None  # NaN: the batch's returns were constant
    if metrics.get(SUCCESS) is not None:
        step_signals = (float(metrics[SUCCESS]), float(metrics.get(ZERO_SIGNAL, 0.0)), ev)
        signals = (*signals, step_signals)[-rule.window_steps:]
    decision = decide(algo, signals, rule)
    if not decision.switched:
        return dataclasses.replace(position, algo=algo, signals=signals)
    values = {"rolling_success": decision.success, "rolling_zero_signal": decision.zero_signal,
              "threshold": getattr(rule, decision.threshold)}
    if decision.critic_ev is not None:
        values["rolling_critic_ev"] = decision.critic_ev
    if ev is not None:  # this step's batch, before the critic was fitted on it
        values["critic/explained_variance"] = ev
    index = position.stage_index
    switch = StageSwitch(index, index, algo, position.global_step + position.stage_step, position.stage_step,
                         True, to_algo=decision.algo, reason=f"{decision.threshold}: {decision.reason}",
                         values=values)
    return dataclasses.replace(position, algo=decision.algo, signals=(), switches=(*position.switches, switch))


# ---- stages -------------------------------------------------------------------------------------------------


def stages_of(config: Config) -> tuple[StageConfig, ...]:
    """`schedule.stages`, or the default run: bc, then `algo.name` for its configured steps."""
    if config.schedule.stages:
        return tuple(config.schedule.stages)
    stages = [StageConfig(algo="bc", steps=config.bc.steps)]
    steps = {"rest": config.rest.iterations, "dpo": config.dpo.iterations,
             "mcts": config.mcts.iterations}.get(config.algo.name, config.algo.steps)
    if config.algo.name != "bc":
        stages.append(StageConfig(algo=config.algo.name, steps=steps))
    return tuple(stages)


def stage_config(config: Config, stage: StageConfig) -> Config:
    """The run config as one stage sees it: its algorithm, its step budget and its algo overrides."""
    tree = config.to_dict()
    tree["algo"] |= {**stage.algo_overrides, "name": stage.algo}
    if stage.algo == "bc":
        tree["bc"]["steps"] = stage.steps
    elif stage.algo == "rest":
        tree["rest"]["iterations"] = stage.steps
    elif stage.algo == "dpo":
        tree["dpo"]["iterations"] = stage.steps
    elif stage.algo == "mcts":
        tree["mcts"]["iterations"] = stage.steps
    else:
        tree["algo"]["steps"] = stage.steps
    return Config.model_validate(tree)


def stage_components(c: Components, stage: StageConfig) -> Components:
    return dataclasses.replace(c, config=stage_config(c.config, stage))


def resume_stage(c: Components, stages: Sequence[StageConfig], position: ScheduleState, logger: RunLogger,
                 saved: Mapping[str, Any] | None) -> StageState | None:
    """The running stage's state rebuilt from its saved `state_dict` (None when the run was saved between
    stages). Building the empty state to load into draws nothing from the run's RNGs (a critic's fresh head
    would), which the checkpoint restored as they were."""
    if saved is None or position.stage_index >= len(stages):
        return None
    stage = stages[position.stage_index]
    kind = STAGES.get(stage.algo)
    with torch.random.fork_rng(devices=[]):
        return kind.start(stage_components(c, stage), logger, position.first_step(kind.numbered), saved)


StageEnd = Callable[[RunState, int, StageConfig, int], RunState]
"""(run state, stage index, stage, steps it took) -> run state: e.g. checkpoint and evaluate after BC."""


def log_switch(logger: RunLogger, switch: StageSwitch) -> None:
    """A switch as a `schedule` record (numbers only, as every sink takes) and a line on the display."""
    record = {"schedule/from_stage": float(switch.from_stage), "schedule/to_stage": float(switch.to_stage),
              "schedule/stage_steps": float(switch.stage_steps), "schedule/by_condition": float(switch.by_condition)}
    if switch.within_stage:  # +1: up to ppo, -1: back down to the critic-free algorithm
        record["schedule/direction"] = 1.0 if switch.to_algo == HIGH_ALGO else -1.0
        record |= {(k if "/" in k else f"schedule/{k}"): float(v) for k, v in switch.values.items()}
    logger.log(switch.at_step, "schedule", record)
    if switch.within_stage:
        logger.display.print(f"stage {switch.from_stage}: {switch.algo} -> {switch.to_algo} after step "
                             f"{switch.at_step} ({switch.reason})")
    else:
        logger.display.print(f"stage {switch.from_stage} ({switch.algo}) ended after {switch.stage_steps} steps"
                             + (f": {switch.reason}" if switch.by_condition else ""))


def end_stage(run: RunState, index: int, stage: StageConfig, logger: RunLogger, next_algo: str | None = None
              ) -> RunState:
    """Record the switch to the next stage and log it."""
    p = run.schedule
    global_step = p.global_step + (0 if not STAGES.get(stage.algo).numbered else p.stage_step)
    reason = (f"rolling {stage.until_metric} reached {stage.until_value}" if p.by_condition else
              "its own stop rule" if p.stopped else "its step budget")
    switch = StageSwitch(index, index + 1, stage.algo, global_step, p.stage_step, p.by_condition,
                         to_algo=next_algo, reason=reason)
    log_switch(logger, switch)
    return RunState(ScheduleState(stage_index=index + 1, global_step=global_step, switches=(*p.switches, switch)),
                    None, run.info)


def logged(logger: RunLogger, before: ScheduleState, after: ScheduleState) -> ScheduleState:
    """`after`, with the switches it added since `before` logged."""
    for switch in after.switches[len(before.switches):]:
        log_switch(logger, switch)
    return after


def run_schedule(c: Components, logger: RunLogger, stages: Sequence[StageConfig], run: RunState | None = None, *,
                 store: TrajectoryStore | None = None, save: Save = no_save,
                 on_stage_end: StageEnd | None = None) -> RunState:
    """Run `stages` in order from `run` (a fresh run by default, or a resumed one); `save` after every step and
    at every stage end."""
    run = run or RunState()
    while run.schedule.stage_index < len(stages):
        index = run.schedule.stage_index
        stage = stages[index]
        kind = STAGES.get(stage.algo)
        sc = stage_components(c, stage)
        rule = sc.config.adaptive if kind.select_algo is not None else None
        if stage.steps > 0:
            if run.stage is None:
                run = dataclasses.replace(run, stage=kind.start(sc, logger, run.schedule.first_step(kind.numbered),
                                                                None))
            if rule is not None and run.schedule.algo is None:
                run = dataclasses.replace(run, schedule=dataclasses.replace(run.schedule, algo=rule.low_algo))
            try:
                run = run_stage(stage.algo, kind, sc, logger, run, store=store, save=save,
                                advance=lambda p, metrics, stop, stage=stage, rule=rule: logged(
                                    logger, p, advance(p, stage, metrics, stop, rule)))
            finally:  # a rollout runner (Ray workers, a vLLM engine or server) starts on the stage's copy: the
                runner = getattr(sc, "rollout_runner", None)  # next stage reuses it, the run's end closes it
                if runner is not None:
                    c.rollout_runner = runner
        taken = run.schedule.stage_step
        run = end_stage(run, index, stage, logger, stages[index + 1].algo if index + 1 < len(stages) else None)
        if on_stage_end is not None:
            run = on_stage_end(run, index, stage, taken)
        save(c, run, run.schedule.global_step)
    return run
