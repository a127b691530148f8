"""Stage schedules (switch condition, state record, resume) and the online-RL registry / dynamic sampling,
with stub stages and stub rollouts (no model)."""

import dataclasses
import json
from types import SimpleNamespace
from typing import get_args

import pytest

from agentgrad.config import ALGORITHMS, AlgoConfig, ConfigError, StageConfig, build_config
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines import rl, schedule
from agentgrad.pipelines.run_state import RunInfo, RunState, ScheduleState, Stage
from agentgrad.pipelines.schedule import run_schedule, should_switch, stage_config, stages_of
from agentgrad.registry import Registry
from agentgrad.sinks import MemorySink
from agentgrad.types import RewardBreakdown, ScoredTrajectory, StopReason, Task, Trajectory, TrajectoryGroup


def test_registries_cover_the_config_names():
    assert set(schedule.STAGES.names()) == set(ALGORITHMS) == set(get_args(AlgoConfig.model_fields["name"].annotation))
    assert set(rl.ONLINE_ALGORITHMS.names()) == {"grpo", "rloo", "reinforce_pp", "ppo"}
    assert rl.ONLINE_ALGORITHMS.get("ppo").uses_critic and rl.ONLINE_ALGORITHMS.get("ppo").estimator == "gae"


def test_should_switch_needs_a_full_window():
    assert not should_switch([0.9, 0.9], 0.15, 3)  # only 2 of 3 values measured
    assert not should_switch([0.0, 0.1, 0.2, 0.1], 0.15, 3)  # last 3: (0.1 + 0.2 + 0.1) / 3 = 0.1333 < 0.15
    assert should_switch([0.0, 0.1, 0.2, 0.15], 0.15, 3)  # (0.1 + 0.2 + 0.15) / 3 = 0.15 >= 0.15


def test_state_round_trips_through_json():
    s = ScheduleState(stage_index=1, stage_step=3, global_step=7, window=(0.1, 0.2),
                      switches=(schedule.StageSwitch(0, 1, "bc", 0, 5, False),), stopped=True, by_condition=True)
    text = json.dumps(s.to_dict())
    assert ScheduleState.from_dict(json.loads(text)) == s
    assert json.loads(text)["switches"][0]["algo"] == "bc"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.stage_index = 2  # type: ignore[misc]
    info = RunInfo().with_eval("bc", {"success_rate": 0.5}).with_steps("bc", 3).with_steps("bc", 2)
    assert RunInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info and info.steps_by_algo == {"bc": 5}


def test_default_stages_and_stage_config():
    cfg = build_config(overrides=["algo=ppo", "algo.steps=9", "bc.steps=4"])
    assert [(s.algo, s.steps) for s in stages_of(cfg)] == [("bc", 4), ("ppo", 9)]
    cfg = build_config(overrides=["algo=rest", "rest.iterations=3"])
    assert [(s.algo, s.steps) for s in stages_of(cfg)][1] == ("rest", 3)
    stage = StageConfig(algo="grpo", steps=5, algo_overrides={"lr": 5e-5})
    sc = stage_config(cfg, stage)
    assert (sc.algo.name, sc.algo.steps, sc.algo.lr) == ("grpo", 5, 5e-5)
    assert stage_config(cfg, StageConfig(algo="dpo", steps=6)).dpo.iterations == 6


def test_stage_overrides_are_validated():
    with pytest.raises(ConfigError, match="algo_overrides"):
        build_config(overrides=["schedule.stages=[{algo: grpo, steps: 2, algo_overrides: {lrr: 1}}]"])
    with pytest.raises(ConfigError):
        build_config(overrides=["schedule.stages=[{algo: sarsa, steps: 2}]"])


@dataclasses.dataclass
class _Components:
    """Just what run_schedule touches (it swaps the config per stage with dataclasses.replace)."""

    config: object


@dataclasses.dataclass
class _Count:
    """A stub stage's state: the steps it ran since it was built or loaded."""

    steps: int = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, saved):
        self.steps = saved["steps"]


def _fake_stages(monkeypatch, success_by_algo, calls):
    """Stub stages whose step `i` reports success_by_algo[name][i]; `calls` records each start (name, first step
    number, resumed?) and each step (name, step number)."""
    fake = Registry("stage algorithm")

    def stage(name):
        budget = (lambda config: config.bc.steps) if name == "bc" else (lambda config: config.algo.steps)

        def start(c, logger, first_step, saved):
            calls.append(("start", name, first_step, saved is not None))
            state = _Count()
            if saved is not None:
                state.load_state_dict(saved)
            return state

        def step(c, logger, store, state, number):
            calls.append((name, number))
            state.steps += 1
            return {"rollout/success_rate": success_by_algo[name][state.steps - 1]}
        return Stage(budget=budget, start=start, step=step, numbered=name != "bc")

    for name in success_by_algo:
        fake.add(name, stage(name))
    monkeypatch.setattr(schedule, "STAGES", fake)


def test_schedule_switches_on_rolling_success_logs_it_and_resumes(monkeypatch):
    cfg = build_config(overrides=["run.progress=false"])
    stages = [StageConfig(algo="bc", steps=2),
              StageConfig(algo="grpo", steps=10, until_metric="rollout/success_rate", until_value=0.15, window_steps=2),
              StageConfig(algo="ppo", steps=3)]
    success = {"bc": [0, 0], "grpo": [0.0, 0.1, 0.1, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9], "ppo": [0.5] * 3}
    calls = []
    _fake_stages(monkeypatch, success, calls)
    sink = MemorySink()
    c = _Components(cfg)
    saved = []
    final = run_schedule(c, RunLogger([sink], ProgressDisplay(enabled=False)), stages,
                         save=lambda c, run, step: saved.append((step, run)))
    # grpo: windows of 2 -> (0, .1) .05, (.1, .1) .1, (.1, .3) .2 >= .15 at its 4th step.
    assert [(s.algo, s.stage_steps, s.by_condition) for s in final.schedule.switches] == [
        ("bc", 2, False), ("grpo", 4, True), ("ppo", 3, False)]
    assert final.schedule.global_step == 7 and final.schedule.stage_index == 3  # BC steps draw no tasks
    # ppo's task seeds continue after grpo's; BC numbers its own steps
    assert [x for x in calls if x[0] == "start"] == [("start", "bc", 0, False), ("start", "grpo", 0, False),
                                                      ("start", "ppo", 4, False)]
    assert [x[1] for x in calls if x[0] == "ppo"] == [4, 5, 6]
    switch_logs = [m for _, stage, m in sink.records if stage == "schedule"]
    assert [m["schedule/by_condition"] for m in switch_logs] == [0.0, 1.0, 0.0]
    # one save after every step (its number) and one at every stage end (the global step, between stages)
    assert [(step, run.stage is None) for step, run in saved] == [
        (1, False), (2, False), (0, True), (1, False), (2, False), (3, False), (4, False), (4, True),
        (5, False), (6, False), (7, False), (7, True)]
    assert saved[-1][1] == final
    mid_grpo = saved[4][1]  # after grpo's 2nd step: its state and its window of one value (the 2nd)
    assert (mid_grpo.schedule.stage_index, mid_grpo.schedule.stage_step, mid_grpo.schedule.window) == (1, 2, (0.0, 0.1))
    assert mid_grpo.stage.steps == 4  # the same object, stepped on since: what is saved is its state_dict then

    # Resume in the middle of grpo (2 steps done, window holds its last value) with its saved state: it runs the
    # 8 steps left, numbered from step 2, and the carried window lets the condition fire one step later.
    calls.clear()
    mid = RunState(ScheduleState(stage_index=1, stage_step=2, global_step=0, window=(0.1,)),
                   schedule.STAGES.get("grpo").start(c, None, 0, {"steps": 2}))
    success["grpo"] = [0.0, 0.0, 0.3, 0.3] + [0.0] * 6
    resumed = run_schedule(c, RunLogger([MemorySink()], ProgressDisplay(enabled=False)), stages, mid)
    assert calls[1] == ("grpo", 2)
    assert [(s.algo, s.stage_steps) for s in resumed.schedule.switches] == [("grpo", 3), ("ppo", 3)]


def test_a_stage_that_stopped_before_its_save_is_not_run_again_on_resume(monkeypatch):
    # Saved after the step on which the switch condition fired, killed before the stage-end save: the resumed
    # schedule ends that stage without another step.
    cfg = build_config(overrides=["run.progress=false"])
    stages = [StageConfig(algo="grpo", steps=10, until_metric="rollout/success_rate", until_value=0.5,
                          window_steps=1), StageConfig(algo="ppo", steps=1)]
    calls = []
    _fake_stages(monkeypatch, {"grpo": [1.0] * 10, "ppo": [0.0]}, calls)
    stopped = RunState(ScheduleState(stage_index=0, stage_step=3, window=(1.0,), stopped=True, by_condition=True),
                       schedule.STAGES.get("grpo").start(None, None, 0, {"steps": 3}))
    calls.clear()
    out = run_schedule(_Components(cfg), RunLogger([MemorySink()], ProgressDisplay(enabled=False)), stages, stopped)
    assert [x for x in calls if x[0] == "grpo"] == []
    assert [(s.algo, s.stage_steps, s.by_condition, s.at_step) for s in out.schedule.switches] == [
        ("grpo", 3, True, 3), ("ppo", 1, False, 4)]


# ---- dynamic sampling ---------------------------------------------------------------------------------------


def _group(name: str, rewards) -> TrajectoryGroup:
    t = Task(name, "p", "a")
    traj = Trajectory(task=t, token_ids=(1, 2), loss_mask=(0, 1), logprobs=(0.0, -0.5), prompt_length=1, turns=(),
                      stop_reason=StopReason.ANSWERED)
    return TrajectoryGroup(t, tuple(ScoredTrajectory(traj, RewardBreakdown(r), r > 0) for r in rewards))


@pytest.mark.parametrize("mode,max_rounds,expected_rounds,expected_kept", [
    ("keep", 3, 1, ["r0a", "r0b", "r0c"]),  # all groups, zero-signal ones included
    ("filter", 3, 1, ["r0b"]),  # round 0 has one group with signal
    ("resample", 3, 3, ["r0b", "r1a", "r2b"]),  # 1 + 1 + 1 signal groups: full (3) after round 2
    ("resample", 1, 2, ["r0b", "r1a"]),  # bounded: one extra round only, train on the 2 found
])
def test_dynamic_sampling(monkeypatch, mode, max_rounds, expected_rounds, expected_kept):
    rounds = {0: [_group("r0a", [0, 0]), _group("r0b", [1, 0]), _group("r0c", [1, 1])],
              1: [_group("r1a", [0, 1]), _group("r1b", [0, 0]), _group("r1c", [0, 0])],
              2: [_group("r2a", [0, 0]), _group("r2b", [1, 0]), _group("r2c", [1, 0])],
              3: [_group("r3a", [1, 0])] * 3}
    monkeypatch.setattr(rl, "rl_tasks", lambda c, step, round_index=0, n=None, kind_counts=None: round_index)
    monkeypatch.setattr(rl, "rollout_groups", lambda c, tasks, step, group_size=None, round_index=0: rounds[tasks])
    cfg = build_config(overrides=["algo.tasks_per_step=3", f"algo.zero_signal={mode}",
                                  f"algo.max_resample_rounds={max_rounds}"])
    out = rl.collect_groups(SimpleNamespace(config=cfg), step=0)
    assert out.rounds == expected_rounds
    assert [g.task.task_id for g in out.groups] == expected_kept
    assert len(out.sampled) == 3 * expected_rounds
