"""The adaptive stage's band rule (GRPO <-> PPO with hysteresis): the pure decision, the schedule that runs it
on a scripted metric stream (switch up, no flapping inside the band, switch back, the zero-signal gate), its
records and resume, the config, and the critic's Monte-Carlo targets. Stub stages, no model."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from agentgrad.config import AdaptiveConfig, ConfigError, build_config
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines import schedule
from agentgrad.pipelines.adaptive import decide
from agentgrad.pipelines.rl import monte_carlo_returns
from agentgrad.pipelines.run_state import RunState, ScheduleState, Stage
from agentgrad.pipelines.schedule import run_schedule, stages_of
from agentgrad.registry import Registry
from agentgrad.sinks import MemorySink

RULE = AdaptiveConfig(up_at=0.15, down_at=0.05, max_zero_signal=0.5, window_steps=3)  # min_critic_ev 0


def test_decide_needs_a_full_window_and_fires_on_the_band_edges():
    assert decide("grpo", [(0.9, 0.0, 0.5), (0.9, 0.0, 0.5)], RULE).algo == "grpo"  # 2 of 3 steps measured
    # Exact binary fractions, so the edges are exact: success 0.25 (>= up_at 0.25) fires, 0.125 (not < 0.125)
    # does not.
    rule = AdaptiveConfig(up_at=0.25, down_at=0.125, max_zero_signal=0.5, window_steps=2)
    up = decide("grpo", [(0.0, 0.5, None), (0.25, 0.5, 0.5), (0.25, 0.5, None)], rule)  # last 2 only
    assert (up.algo, up.threshold, up.success, up.zero_signal, up.critic_ev) == ("ppo", "up_at", 0.25, 0.5, 0.5)
    assert "up_at 0.25" in up.reason
    stay = decide("ppo", [(0.125, 0.0, None), (0.125, 0.0, None)], rule)  # mean 0.125 is not below down_at
    assert (stay.algo, stay.switched) == ("ppo", False)
    down = decide("ppo", [(0.125, 0.0, None), (0.0, 1.0, None)], rule)  # (0.125 + 0) / 2 = 0.0625 < 0.125
    assert (down.algo, down.threshold, down.success) == ("grpo", "down_at", 0.0625)
    # Success above up_at but most groups carry no signal: (0.75 + 0.5) / 2 = 0.625 > 0.5, GRPO stays.
    gated = decide("grpo", [(0.5, 0.75, 0.5), (0.5, 0.5, 0.5)], rule)
    assert (gated.algo, gated.switched) == ("grpo", False) and "zero-signal above" in gated.reason
    # The critic: (0.25 - 0.25) / 2 = 0 is not above min_critic_ev 0 (a zero head measures exactly 0), nor is a
    # window without any measurement; with min_critic_ev None the same window switches.
    for evs in ((0.25, -0.25), (None, None)):
        waiting = decide("grpo", [(0.5, 0.0, evs[0]), (0.5, 0.0, evs[1])], rule)
        assert (waiting.algo, waiting.switched) == ("grpo", False) and "min_critic_ev" in waiting.reason
    no_wait = rule.model_copy(update={"min_critic_ev": None})
    assert decide("grpo", [(0.5, 0.0, None), (0.5, 0.0, None)], no_wait).algo == "ppo"
    with pytest.raises(ValueError, match="adaptive stage runs"):
        decide("rloo", [], rule)


def test_no_flapping_inside_the_band():
    # Success alternates 0.04 / 0.16, each step's value outside the band on either side; every window of 3 has
    # mean (0.04 + 0.16 + 0.04) / 3 = 0.08 or (0.16 + 0.04 + 0.16) / 3 = 0.12, inside [0.05, 0.15): no switch
    # in either direction, whichever algorithm runs.
    stream = [(0.04 if i % 2 == 0 else 0.16, 0.2, 0.3) for i in range(30)]
    for algo in ("grpo", "ppo"):
        assert all(not decide(algo, stream[:i + 1], RULE).switched for i in range(len(stream)))


# The scripted stream, one (success, zero-signal, critic explained variance) per step of the adaptive stage,
# with window 3, up_at 0.15, down_at 0.05, max_zero_signal 0.5, min_critic_ev 0 (RULE). Worked out by hand:
#  steps 1-3 grpo: the window fills at step 3: success (0 + .1 + .1) / 3 = .067, in the band: stay.
#  step 4: success (.1 + .1 + .3) / 3 = .167 >= .15, zero-signal (.6 + .4 + .4) / 3 = .467 <= .5, but the
#          critic's (-.05 - .04 + .03) / 3 = -.02 is not above 0: GRPO stays.
#  step 5: success (.1 + .3 + .2) / 3 = .2, zero-signal .4, critic (-.04 + .03 + .42) / 3 = .137: UP (ppo from
#          step 6); the window restarts.
#  steps 6-9 ppo: full at 8: (.1 + .06 + .1) / 3 = .087, at 9: (.06 + .1 + .02) / 3 = .06: in the band, stay.
#  step 10: (.1 + .02 + 0) / 3 = .04 < .05: DOWN (grpo from step 11); its critic measurement is NaN (constant
#          returns) and is left out.
#  steps 11-13 grpo: success .3 each, but zero-signal (.8 + .7 + .6) / 3 = .7 > .5: the gate holds GRPO.
#  step 14: zero-signal (.7 + .6 + .1) / 3 = .467 <= .5, success .3, critic .1: UP (ppo runs step 15, the last).
NAN = float("nan")
STREAM = [(0.0, 0.9, 0.0), (0.1, 0.6, -0.05), (0.1, 0.4, -0.04), (0.3, 0.4, 0.03), (0.2, 0.4, 0.42),
          (0.1, 0.5, 0.2), (0.06, 0.5, 0.2), (0.1, 0.6, 0.2), (0.02, 0.7, 0.2), (0.0, 0.9, NAN),
          (0.3, 0.8, 0.1), (0.3, 0.7, 0.1), (0.3, 0.6, 0.1), (0.3, 0.1, 0.1),
          (0.3, 0.1, 0.1)]
ALGO_PER_STEP = ["grpo"] * 5 + ["ppo"] * 5 + ["grpo"] * 4 + ["ppo"]


@dataclasses.dataclass
class _Components:
    """Just what run_schedule touches (it swaps the config per stage with dataclasses.replace)."""

    config: object


@dataclasses.dataclass
class _Scripted:
    """A stub adaptive stage's state: the algorithm the schedule selected and the steps it ran."""

    algo: str = ""
    steps: int = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, saved):
        self.steps = saved["steps"]


def _scripted_stage(monkeypatch, ran):
    """An adaptive stage whose step `i` (0-based within the stage) reports STREAM[i]; `ran` records (step
    number, the algorithm it was told to run)."""

    def start(c, logger, first_step, saved):
        state = _Scripted()
        if saved is not None:
            state.load_state_dict(saved)
        return state

    def step(c, logger, store, state, number):
        ran.append((number, state.algo))
        success, zero, ev = STREAM[state.steps]
        state.steps += 1
        return {"rollout/success_rate": success, "rollout/zero_signal_groups": zero, "critic/explained_variance": ev}

    fake = Registry("stage algorithm")
    fake.add("adaptive", Stage(budget=lambda config: config.algo.steps, start=start, step=step,
                               select_algo=lambda state, algo: setattr(state, "algo", algo)))
    fake.add("bc", Stage(budget=lambda config: config.bc.steps, start=lambda *a: _Scripted(),
                         step=lambda *a: {}, numbered=False))
    monkeypatch.setattr(schedule, "STAGES", fake)


CONFIG = ["run.progress=false", "adaptive.up_at=0.15", "adaptive.down_at=0.05", "adaptive.max_zero_signal=0.5",
          "adaptive.window_steps=3", "schedule.stages=[{algo: bc, steps: 1}, {algo: adaptive, steps: 15}]"]


def test_scripted_stream_switches_up_and_back_at_the_hand_computed_steps_and_resumes(monkeypatch):
    cfg = build_config(overrides=CONFIG)
    ran = []
    _scripted_stage(monkeypatch, ran)
    c, sink, saved = _Components(cfg), MemorySink(), []
    final = run_schedule(c, RunLogger([sink], ProgressDisplay(enabled=False)), stages_of(cfg),
                         save=lambda c, run, step: saved.append(run))
    assert ran == [(i, algo) for i, algo in enumerate(ALGO_PER_STEP)]  # steps numbered 0..14, BC draws none
    inside = [s for s in final.schedule.switches if s.within_stage]
    assert [(s.algo, s.to_algo, s.at_step, s.stage_steps, s.reason.split(":")[0]) for s in inside] == [
        ("grpo", "ppo", 5, 5, "up_at"), ("ppo", "grpo", 10, 10, "down_at"), ("grpo", "ppo", 14, 14, "up_at")]
    up = inside[0].values
    assert up["rolling_success"] == pytest.approx(0.2) and up["rolling_zero_signal"] == pytest.approx(0.4)
    assert up["rolling_critic_ev"] == pytest.approx(0.41 / 3) and up["critic/explained_variance"] == 0.42
    assert up["threshold"] == 0.15
    down = inside[1].values
    assert down["rolling_success"] == pytest.approx(0.04) and down["threshold"] == 0.05
    assert "critic/explained_variance" not in down and down["rolling_critic_ev"] == pytest.approx(0.2)
    end = final.schedule.switches[-1]  # the stage's end, after its budget
    assert (end.from_stage, end.to_stage, end.algo, end.to_algo, end.stage_steps) == (1, 2, "adaptive", None, 15)
    assert end.reason == "its step budget" and final.schedule.switches[0].to_algo == "adaptive"
    # Every switch is a `schedule` record at its step, with the direction, the rolling values and the threshold.
    records = [(step, m) for step, stage, m in sink.records if stage == "schedule" and "schedule/direction" in m]
    assert [(step, m["schedule/direction"], m["schedule/threshold"]) for step, m in records] == [
        (5, 1.0, 0.15), (10, -1.0, 0.05), (14, 1.0, 0.15)]
    assert records[0][1]["critic/explained_variance"] == 0.42
    assert json.loads(json.dumps(final.schedule.to_dict()))["switches"][1]["to_algo"] == "ppo"

    # Killed after step 7 (ppo, two steps into its window): the schedule alone, through JSON as a checkpoint
    # holds it, resumes the same algorithm and window, and the rest of the run switches at the same steps.
    mid = saved[1 + 1 + 7 - 1]  # BC's step, BC's end, then the adaptive stage's 7th step
    assert (mid.schedule.stage_step, mid.schedule.algo, len(mid.schedule.signals)) == (7, "ppo", 2)
    position = ScheduleState.from_dict(json.loads(json.dumps(mid.schedule.to_dict())))
    assert position == mid.schedule
    ran.clear()
    resumed = run_schedule(c, RunLogger([MemorySink()], ProgressDisplay(enabled=False)), stages_of(cfg),
                           RunState(position, schedule.STAGES.get("adaptive").start(c, None, 0, {"steps": 7})))
    assert ran == [(i, algo) for i, algo in enumerate(ALGO_PER_STEP)][7:]
    assert resumed.schedule.switches == final.schedule.switches


def test_adaptive_config():
    cfg = build_config(overrides=["algo=adaptive", "algo.steps=7"])
    assert [(s.algo, s.steps) for s in stages_of(cfg)] == [("bc", cfg.bc.steps), ("adaptive", 7)]
    defaults = cfg.adaptive
    assert (defaults.low_algo, defaults.up_at, defaults.down_at, defaults.max_zero_signal, defaults.window_steps,
            defaults.warm_critic, defaults.min_critic_ev) == ("grpo", 0.15, 0.05, 0.5, 5, True, 0.0)
    assert build_config().algo.name == "grpo"  # the default run does not change
    with pytest.raises(ConfigError, match="must be below adaptive.up_at"):
        build_config(overrides=["adaptive.up_at=0.1", "adaptive.down_at=0.1"])
    with pytest.raises(ConfigError, match="min_critic_ev=null"):
        build_config(overrides=["adaptive.warm_critic=false"])
    assert build_config(overrides=["adaptive.warm_critic=false", "adaptive.min_critic_ev=null"]).adaptive
    with pytest.raises(ConfigError, match="up_att"):
        build_config(overrides=["adaptive.up_att=0.2"])
    with pytest.raises(ConfigError):
        build_config(overrides=["adaptive.low_algo=ppo"])  # the low algorithm trains no critic


def test_monte_carlo_returns_are_the_discounted_reward_to_go_over_policy_tokens():
    # One row, tokens: prompt, 2 policy tokens (turn 1, process reward 0.5 on its last), an observation token,
    # 2 policy tokens (turn 2, outcome 1 on its last). gamma 0.5 per policy token, the observation skipped:
    #   last token: 1;  its predecessor: 0 + 0.5 * 1 = 0.5;  turn 1's last: 0.5 + 0.5 * 0.5 = 0.75;
    #   turn 1's first: 0 + 0.5 * 0.75 = 0.375; prompt and observation: 0.
    mask = torch.tensor([[0, 1, 1, 0, 1, 1]])  # (1, 6)
    rewards = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.0, 1.0]])  # (1, 6)
    batch = SimpleNamespace(token_rewards=rewards, loss_mask=mask, group_index=torch.tensor([0]))
    c = SimpleNamespace(config=build_config(overrides=["algo.gamma=0.5"]))
    returns = monte_carlo_returns(c, batch)  # (1, 6)
    assert returns.tolist() == [[0.0, 0.375, 0.75, 0.0, 0.5, 1.0]]
