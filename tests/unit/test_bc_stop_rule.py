"""BC's stop rule on scripted validation signals: smoothing, dense checks near the phase change, keep-best, and
the early warning. No model is trained: `bc_step` and `validation_success` are replaced by scripts."""

from types import SimpleNamespace

import pytest
import torch

from agentgrad.config import build_config
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines import bc
from agentgrad.pipelines.bc import StopRule
from agentgrad.sinks import MemorySink


def test_one_lucky_check_does_not_stop_and_the_mean_of_the_window_does():
    rule = StopRule(target=0.3, window=2)
    model = torch.nn.Linear(2, 2)
    assert not rule.observe(0.9, 2, model, keep_best=False)  # one check only: the window is not full
    rule = StopRule(target=0.3, window=2)
    assert not rule.observe(0.0, 2, model, keep_best=False)
    assert not rule.observe(0.5, 3, model, keep_best=False)  # mean 0.25
    # the window's mean, (0.5 + 0.125) / 2 = 0.3125, reaches 0.3; the whole history's, 0.208, would not
    assert rule.observe(0.125, 4, model, keep_best=False)


def test_keep_best_remembers_the_weights_of_the_best_smoothed_check():
    model = torch.nn.Linear(1, 1, bias=False)
    rule = StopRule(target=1.0, window=2)
    for step, (weight, success) in enumerate([(1.0, 0.0), (2.0, 0.4), (3.0, 0.6), (4.0, 0.1)], start=1):
        model.weight.data.fill_(weight)
        rule.observe(success, step, model, keep_best=True)
    # smoothed: 0.0, 0.2, 0.5, 0.35 -> best at step 3, whose weight was 3.0
    assert rule.best == pytest.approx(0.5) and rule.best_step == 3
    assert rule.best_state["weight"].item() == 3.0


def _run(monkeypatch, script, *overrides):
    """run_bc with scripted validation successes; returns (steps taken, checked steps, sink, printed lines)."""
    checked: list[int] = []
    scales: list[float] = []
    step_box = {"step": 0}

    def fake_step(c, demos, rng, step, lr_scale=1.0):
        step_box["step"] = step + 1
        scales.append(lr_scale)
        c.loaded.model.weight.data.fill_(float(step + 1))
        return {"loss/bc": 0.0, "perf/policy_tokens": 1.0}

    def fake_validation(c, num_tasks=None):
        checked.append(step_box["step"] if num_tasks is None else (step_box["step"], num_tasks))
        return script(step_box["step"]) if num_tasks is None else script(step_box["step"], num_tasks)

    monkeypatch.setattr(bc, "bc_step", fake_step)
    monkeypatch.setattr(bc, "validation_success", fake_validation)
    config = build_config(overrides=["run.progress=false", *overrides])
    c = SimpleNamespace(config=config, loaded=SimpleNamespace(model=torch.nn.Linear(1, 1, bias=False)))
    sink = MemorySink()
    printed: list[str] = []
    display = ProgressDisplay(enabled=False)
    monkeypatch.setattr(display, "print", printed.append)
    steps = bc.run_bc(c, RunLogger([sink], display), demos=[object()])
    c.lr_scales = scales
    return steps, checked, sink, printed, c


def test_checks_every_eval_every_steps_then_every_step_once_any_succeeds(monkeypatch):
    # A phase change: nothing until step 10, then +10 points a step.
    script = lambda step: max(0.0, (step - 9) * 0.1)  # noqa: E731
    steps, checked, _, printed, c = _run(monkeypatch, script, "bc.steps=100", "bc.eval_every=4",
                                         "bc.stop_at_success=0.3", "bc.stop_window=2",
                                         "bc.lr_scale_near_target=0.25")
    # checks at 4, 8, 12 (0.3: the first success), then every step: 13 (0.4) -> mean 0.35 >= 0.3 stops
    assert checked == [4, 8, 12, 13] and steps == 13
    assert c.lr_scales == [1.0] * 12 + [0.25]  # the step after the first success runs at a quarter of the lr
    assert any("BC stopped at step 13" in line for line in printed)


def test_dense_checks_wait_for_dense_checks_from_while_the_lr_slows_at_the_first_success(monkeypatch):
    # Success trickles in: 1% a step from step 10 (api-catalog's slow phase change).
    script = lambda step: max(0.0, (step - 9) * 0.01)  # noqa: E731
    steps, checked, _, _, c = _run(monkeypatch, script, "bc.steps=100", "bc.eval_every=10",
                                   "bc.stop_at_success=0.3", "bc.stop_window=2", "bc.dense_checks_from=0.15",
                                   "bc.lr_scale_near_target=0.5")
    # every 10 steps while the best smoothed check is below 0.15: 10 (0.01), 20 (0.11 -> mean 0.06), 30 (0.21 ->
    # mean 0.16 >= 0.15), then every step: 31 (0.22 -> 0.215) ... 39 (0.30 -> 0.295), 40 (0.31 -> 0.305) stops
    assert checked == [10, 20, *range(30, 41)] and steps == 40
    assert c.lr_scales == [1.0] * 10 + [0.5] * 30  # the lr still slows from the first success (step 10)


def test_dense_checks_come_every_dense_eval_every_steps(monkeypatch):
    # The trickle above, checked every 4 steps once dense.
    script = lambda step: max(0.0, (step - 9) * 0.01)  # noqa: E731
    steps, checked, _, _, _ = _run(monkeypatch, script, "bc.steps=100", "bc.eval_every=10",
                                   "bc.stop_at_success=0.3", "bc.stop_window=2", "bc.dense_checks_from=0.15",
                                   "bc.dense_eval_every=4")
    # 10, 20, 30 as above (the mean reaches 0.16 at 30), then 32 (0.23 -> 0.22), 36 (0.27 -> 0.25), 40 (0.31 ->
    # 0.29), 44 (0.35 -> 0.33) stops: four steps later than checking every step (40 above)
    assert checked == [10, 20, 30, 32, 36, 40, 44] and steps == 44


def test_a_bc_that_never_gets_there_hands_on_its_best_check_and_warns_at_half_budget(monkeypatch):
    script = lambda step: {10: 0.1, 11: 0.1, 12: 0.0}.get(step, 0.0)  # noqa: E731
    steps, checked, _, printed, c = _run(monkeypatch, script, "bc.steps=20", "bc.eval_every=5",
                                         "bc.stop_at_success=0.9", "bc.stop_window=2")
    assert steps == 20
    # smoothed best: (0.1 + 0.1) / 2 at step 11 -> the weights written at step 11 are handed on
    assert c.loaded.model.weight.item() == 11.0
    assert any(line.startswith("warning: BC is at step 10 of 20") for line in printed), printed
    assert any("RL starts from its best check (step 11, 10%)" in line for line in printed), printed


def test_probes_stand_for_checks_on_the_plateau_and_a_probe_that_sees_success_is_redone_in_full(monkeypatch):
    """bc.probe_tasks=16: before any success each check is a 16-task probe; a probe that sees a success is
    replaced by a full check (num_tasks None: bc.eval_tasks), and from then on every check is full."""
    def script(step, num_tasks=None):
        success = max(0.0, (step - 9) * 0.1)  # the phase change of the test above
        return 0.0 if (step, num_tasks) == (12, 16) else success  # the probe at 12 is unlucky: sees nothing

    steps, checked, sink, _, c = _run(monkeypatch, script, "bc.steps=100", "bc.eval_every=4",
                                      "bc.stop_at_success=0.3", "bc.stop_window=2", "bc.probe_tasks=16")
    # 4, 8, 12: probes see 0 (at 12 by bad luck: a full check would have seen 0.3); 16: the probe sees 0.7, so a
    # full check at 16 (0.7) is what the rule records: the mean of (0.0, 0.7), 0.35, stops. (The unlucky probe
    # cost the slow-down: the test above stops at 13 with 0.4.)
    assert checked == [(4, 16), (8, 16), (12, 16), (16, 16), 16] and steps == 16
    recorded = [m["eval/bc_validation_success"] for _, _, m in sink.records if "eval/bc_validation_success" in m]
    assert recorded == pytest.approx([0.0, 0.0, 0.0, 0.7])
    assert c.lr_scales == [1.0] * 16
