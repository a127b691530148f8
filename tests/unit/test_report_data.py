"""The report's data side, on hand-built records: the run-wide x axis, the switches, the entropy estimate and the
breakdowns (numbers worked out by hand below)."""

from __future__ import annotations

import json
import math

import pytest

from agentgrad.data.store import TrajectoryStore
from agentgrad.report.data import breakdowns, entropy_by_step, read_trajectories, timeline, viewer_records
from agentgrad.types import (
    FinalAnswer,
    InvalidAction,
    RewardBreakdown,
    ScoredTrajectory,
    StopReason,
    Task,
    ToolCall,
    Trajectory,
    Turn,
)

ROWS = [  # the shape `agentgrad train` writes: BC steps 1..3, a switch, evals, RL steps numbered run-wide
    {"step": 0, "stage": "bc", "data/demos": 8.0},
    {"step": 1, "stage": "bc", "loss/bc": 3.0}, {"step": 2, "stage": "bc", "loss/bc": 2.0},
    {"step": 3, "stage": "bc", "loss/bc": 1.0},
    {"step": 0, "stage": "schedule", "schedule/stage_steps": 3.0, "schedule/by_condition": 0.0},
    {"step": 3, "stage": "eval_bc", "eval/success_rate": 0.25},
    {"step": 1, "stage": "grpo", "rollout/success_rate": 0.5},
    {"step": 2, "stage": "grpo", "rollout/success_rate": 0.75},
    {"step": 2, "stage": "schedule", "schedule/stage_steps": 2.0, "schedule/by_condition": 1.0},
    {"step": 3, "stage": "ppo", "rollout/success_rate": 0.8},
    {"step": 3, "stage": "schedule", "schedule/stage_steps": 1.0, "schedule/by_condition": 0.0},
    {"step": 3, "stage": "eval_final", "eval/success_rate": 0.9},
]


def test_stages_are_laid_end_to_end_and_switches_marked():
    t = timeline(ROWS)
    assert [x for x, _ in t.points] == [0, 1, 2, 3, 3, 3, 4, 5, 5, 6, 6, 6]
    assert [(s.x, s.label) for s in t.switches] == [(3, "bc → grpo"), (5, "grpo → ppo (condition)"), (6, "ppo → end")]
    assert t.series("eval/success_rate") == ([3, 6], [0.25, 0.9])
    assert t.rl_step_x == {1: 4, 2: 5, 3: 6}
    t.add_rl_series("rollout/entropy_estimate", {2: 1.5, 3: 1.0, 9: 7.0})  # step 9 was never logged: left out
    assert t.series("rollout/entropy_estimate") == ([5, 6], [1.5, 1.0])


def _sample(task_id: str, turns: tuple, lps: tuple, mask: tuple, *, success: bool, stop=StopReason.ANSWERED,
            masked: bool = False) -> ScoredTrajectory:
    n = len(mask)
    traj = Trajectory(task=Task(task_id, "1 + 2 = ?", "3"), token_ids=tuple(range(n)), loss_mask=mask, logprobs=lps,
                      prompt_length=1, turns=turns, stop_reason=stop)
    reward = RewardBreakdown(0.0, masked=True, reason="judge down") if masked else RewardBreakdown(
        1.0 if success else 0.0, process=(0.1,))
    return ScoredTrajectory(traj, reward, success)


def _store(tmp_path):
    call = Turn(1, 2, "<tool_call>...", ToolCall("calculator", {"expression": "1+2"}), "3", tool_ok=True)
    bad_call = Turn(1, 2, "<tool_call>...", ToolCall("calculator", {"expression": "1/0"}), "error", tool_ok=False,
                    tool_error="bad_arguments")
    answer = Turn(2, 3, "3", FinalAnswer("3"), None)
    invalid = Turn(1, 3, "<tool_call>{", InvalidAction("<tool_call>{", "unterminated tool call"), "error")
    store = TrajectoryStore(tmp_path / "trajectories", fsync=False)
    store.append([_sample("a", (call, answer), (0.0, -1.0, -2.0), (0, 1, 1), success=True),
                  _sample("a", (bad_call, answer), (0.0, -0.5, -0.5), (0, 1, 1), success=False)],
                 step=0, stage="rl", groups=["0:0", "0:0"])
    store.append([_sample("b", (invalid,), (0.0, -3.0, math.inf), (0, 1, 1), success=False,
                          stop=StopReason.INVALID_CALLS, masked=True)], step=1, stage="rl")
    return store


def test_breakdowns_count_tools_stops_and_errors(tmp_path):
    records, bad = read_trajectories(_store(tmp_path).directory)
    assert bad == 0 and len(records) == 3
    b = breakdowns(records)
    assert b["tools"] == {"calculator": {"ok": 1, "error": 1}}
    assert b["stops"] == {"rl": {"answered": 2, "invalid_calls": 1}}
    assert b["errors"] == {"tool: bad_arguments": 1, "invalid action: unterminated tool call": 1,
                           "reward masked: judge down": 1}


def test_entropy_is_the_mean_negative_logprob_of_trained_tokens_per_step(tmp_path):
    records, _ = read_trajectories(_store(tmp_path).directory)
    # step 1 (store step 0): tokens -1, -2, -0.5, -0.5 -> 4/4 = 1.0; step 2: -3 (the inf is skipped) -> 3.0
    assert entropy_by_step(records) == {1: 1.0, 2: 3.0}


def test_viewer_records_keep_groups_whole_and_carry_turns_and_mask(tmp_path):
    records, _ = read_trajectories(_store(tmp_path).directory)
    shown, ids = viewer_records(records, max_records=100)
    assert [r["id"] for r in shown] == [0, 1, 2] and ids == {0, 1, 2}
    first = shown[0]
    assert first["step"] == 1 and first["mask"] == "011" and first["group"] == "rl|0|a"
    assert [t["kind"] for t in first["turns"]] == ["tool", "answer"]
    assert json.loads(first["turns"][0]["args"]) == {"expression": "1+2"} and first["turns"][0]["reward"] == 0.1
    shown, _ = viewer_records(records, max_records=1)  # 3 records, cap 1: every 3rd group -> group a, whole
    assert [r["id"] for r in shown] == [0, 1]


def test_a_torn_line_is_skipped_and_counted(tmp_path):
    store = _store(tmp_path)
    segment = next(store.directory.glob("segment-*.jsonl"))
    with segment.open("a") as fh:
        fh.write('{"index": 3, "step"')  # a run in progress, mid-write
    records, bad = read_trajectories(store.directory)
    assert len(records) == 3 and bad == 1
    assert segment.read_text().endswith('"step"')  # read only: the torn tail is not repaired by the report


def test_tiny_values_get_exponent_ticks_and_the_mismatch_monitor_its_panel():
    pytest.importorskip("plotly", reason="the report extra is not installed")
    from agentgrad.report.figures import PANELS, curve_figure

    rows = [{"step": s, "stage": "grpo", "loss/approx_kl_old": 1e-13 * s, "mismatch/max_abs_logprob_diff": 2e-5}
            for s in (1, 2)]
    panel = next(p for p in PANELS if p.title.startswith("Importance weights"))
    fig = curve_figure(panel, timeline(rows))
    assert {tr.name for tr in fig.data} == {"loss/approx_kl_old", "mismatch/max_abs_logprob_diff"}
    assert fig.layout.yaxis.exponentformat == "e"  # plotly's default SI prefixes read 1e-13 as "100f"
