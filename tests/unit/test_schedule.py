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
from agentgrad.pipelines.schedule import ScheduleState, run_schedule, should_switch, stage_config, stages_of
from agentgrad.registry import Registry
from agentgrad.types import RewardBreakdown, ScoredTrajectory, StopReason, Task, Trajectory, TrajectoryGroup


def test_registries_cover_the_config_names():
    assert set(schedule.STAGES.names()) == set(ALGORITHMS) == set(get_args(AlgoConfig.model_fields["name"].annotation))
    assert set(rl.ONLINE_ALGORITHMS.names()) == {"grpo", "rloo", "reinforce_pp", "ppo"}
    assert rl.ONLINE_ALGORITHMS.get("ppo").uses_critic and rl.ONLINE_ALGORITHMS.get("ppo").estimator == "gae"


def test_should_switch_needs_a_full_window():
    assert not should_switch([0.9, 0.9], 0.15, 3)  # only 2 of 3 values measured
    assert not should_switch([0.0, 0.1, 0.2, 0.1], 0.15, 3)  # last 3: (0.1 + 0.2 + 0.1) / 3 = 0.1333 < 0.15
    assert should_switch([0.0, 0.1, 0.2, 0.15], 0.15, 3)  # (0.1 + 0.2 + 0.15) / 3 = 0.15 >= 0.15


def test_state_round_trips_through_json(tmp_path):
    s = ScheduleState(stage_index=1, stage_step=3, global_step=7, window=(0.1, 0.2),
                      switches=(schedule.StageSwitch(0, 1, "bc", 0, 5, False),))
    s.save(tmp_path / "s.json")
    assert ScheduleState.load(tmp_path / "s.json") == s
    assert json.loads((tmp_path / "s.json").read_text())["switches"][0]["algo"] == "bc"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.stage_index = 2  # type: ignore[misc]


def test_default_stages_and_stage_config():
    cfg = build_config(overrides=["algo=ppo", "algo.steps=9", "bc.steps=4"])
    assert [(s.algo, s.steps) for s in stages_of(cfg)] == [("bc", 4), ("ppo", 9)]
    cfg = build_config(overrides=["algo=rest", "rest.iterations=3"])
    assert [(s.algo, s.steps) for s in stages_of(cfg)][1] == ("rest", 3)
    stage = StageConfig(algo="grpo", steps=5, algo_overrides={"lr": 5e-5})
    sc = stage_config(cfg, stage, remaining_steps=2)
    assert (sc.algo.name, sc.algo.steps, sc.algo.lr) == ("grpo", 2, 5e-5)
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


class _Sink:
    def __init__(self):
        self.records = []

    def write(self, step, stage, metrics):
        self.records.append((step, stage, dict(metrics)))

    def close(self):
        pass


def _fake_stages(monkeypatch, success_by_algo, calls):
    fake = Registry("stage algorithm")

    def runner(name):
        def run(c, logger, store, on_step, first_step):
            calls.append((name, c.config.algo.steps if name != "bc" else c.config.bc.steps, first_step))
            n = c.config.bc.steps if name == "bc" else c.config.algo.steps
            for i in range(n):
                if on_step(first_step + i + 1, {"rollout/success_rate": success_by_algo[name][i]}):
                    return i + 1
            return n
        return run

    for name in success_by_algo:
        fake.add(name, runner(name))
    monkeypatch.setattr(schedule, "STAGES", fake)


def test_schedule_switches_on_rolling_success_logs_it_and_resumes(monkeypatch, tmp_path):
    cfg = build_config(overrides=["run.progress=false"])
    stages = [StageConfig(algo="bc", steps=2),
              StageConfig(algo="grpo", steps=10, until_metric="rollout/success_rate", until_value=0.15, window_steps=2),
              StageConfig(algo="ppo", steps=3)]
    success = {"bc": [0, 0], "grpo": [0.0, 0.1, 0.1, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9], "ppo": [0.5] * 3}
    calls = []
    _fake_stages(monkeypatch, success, calls)
    sink = _Sink()
    c = _Components(cfg)
    final = run_schedule(c, RunLogger([sink], ProgressDisplay(enabled=False)), stages,
                         state_path=tmp_path / "state.json")
    # grpo: windows of 2 -> (0, .1) .05, (.1, .1) .1, (.1, .3) .2 >= .15 at its 4th step.
    assert [(s.algo, s.stage_steps, s.by_condition) for s in final.switches] == [
        ("bc", 2, False), ("grpo", 4, True), ("ppo", 3, False)]
    assert final.global_step == 7 and final.stage_index == 3  # BC steps draw no tasks: not counted
    assert calls == [("bc", 2, 0), ("grpo", 10, 0), ("ppo", 3, 4)]  # ppo's task seeds continue after grpo's
    switch_logs = [m for _, stage, m in sink.records if stage == "schedule"]
    assert [m["schedule/by_condition"] for m in switch_logs] == [0.0, 1.0, 0.0]
    assert ScheduleState.load(tmp_path / "state.json") == final

    # Resume in the middle of grpo (2 steps done, window holds its last value): it runs the 8 steps left,
    # numbered from step 2, and the carried window lets the condition fire one step later.
    calls.clear()
    mid = ScheduleState(stage_index=1, stage_step=2, global_step=0, window=(0.1,))
    success["grpo"] = [0.3, 0.3] + [0.0] * 6
    resumed = run_schedule(c, RunLogger([_Sink()], ProgressDisplay(enabled=False)), stages, state=mid)
    assert calls[0] == ("grpo", 8, 2)
    assert [(s.algo, s.stage_steps) for s in resumed.switches] == [("grpo", 3), ("ppo", 3)]


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
    monkeypatch.setattr(rl, "rl_tasks", lambda c, step, round_index=0, n=None: round_index)
    monkeypatch.setattr(rl, "rollout_groups", lambda c, tasks, step, group_size=None, round_index=0: rounds[tasks])
    cfg = build_config(overrides=["algo.tasks_per_step=3", f"algo.zero_signal={mode}",
                                  f"algo.max_resample_rounds={max_rounds}"])
    out = rl.collect_groups(SimpleNamespace(config=cfg), step=0)
    assert out.rounds == expected_rounds
    assert [g.task.task_id for g in out.groups] == expected_kept
    assert len(out.sampled) == 3 * expected_rounds
