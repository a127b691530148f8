"""What `agentgrad report` shows, read from a run directory: no plotting here, no torch, and nothing written.

- `timeline`: metrics.jsonl on one run-wide x axis. Steps restart per stage (BC counts its own steps, the RL
  stages count RL steps from where the last one ended), so each stage is laid after the previous one and the
  schedule's records (one per stage end) mark the switches.
- `read_trajectories`: the store's segments, read line by line without opening the store (which would repair a
  torn tail, i.e. write, while a run may still be appending); a torn or broken line is counted and skipped.
- `breakdowns`, `entropy_by_step`, `viewer_records`: tool usage, stop reasons, error kinds, the sampled-token
  entropy estimate per step, and the compact records the trajectory viewer renders.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentgrad.data.store import SEGMENT_GLOB, StoreRecord, from_json
from agentgrad.types import FinalAnswer, InvalidAction, ToolCall


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line of a run in progress
                continue
    return rows


@dataclass(frozen=True)
class Switch:
    x: float
    label: str
    by_condition: bool


@dataclass
class Timeline:
    points: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    """(x, metrics row) per record, eval and schedule records included."""
    switches: list[Switch] = field(default_factory=list)
    rl_step_x: dict[int, float] = field(default_factory=dict)
    """x of each step a non-BC stage logged (their steps are numbered run-wide, so they are unique)."""
    derived: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    """Series computed from elsewhere than metrics.jsonl (the entropy estimate, from the trajectories)."""

    def add_rl_series(self, key: str, by_step: Mapping[int, float]) -> None:
        pairs = [(self.rl_step_x[s], v) for s, v in sorted(by_step.items()) if s in self.rl_step_x]
        self.derived[key] = ([p[0] for p in pairs], [p[1] for p in pairs])

    def series(self, key: str) -> tuple[list[float], list[float]]:
        if key in self.derived:
            return self.derived[key]
        pairs = [(x, r[key]) for x, r in self.points if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pairs], [p[1] for p in pairs]


def timeline(rows: Sequence[Mapping[str, Any]]) -> Timeline:
    t = Timeline()
    end = 0.0  # x where the last finished stage ended
    segment: str | None = None  # stage of the training records since the last switch
    step0, last_global, seen = 0, 0, 0.0
    names: list[str] = []  # one per stage, in order
    ended: list[tuple[float, bool]] = []  # (x, by condition) per stage end
    for r in rows:
        stage, step = str(r.get("stage", "")), int(r.get("step", 0))
        if stage == "schedule":
            x = end + float(r.get("schedule/stage_steps", seen))
            if segment is None:  # a stage that logged nothing (zero steps)
                names.append("?")
            ended.append((x, bool(r.get("schedule/by_condition"))))
            end, segment, last_global, seen = x, None, step, 0.0
        elif stage.startswith("eval_"):
            x = end + seen
        else:
            if segment != stage:
                if segment is not None:  # a stage change without a schedule record (an older run)
                    end += seen
                    ended.append((end, False))
                segment, seen = stage, 0.0
                names.append(stage)
                step0 = 0 if stage == "bc" else last_global
            x = end + (step - step0)
            seen = max(seen, float(step - step0))
            if stage != "bc":
                t.rl_step_x[step] = x
        t.points.append((x, dict(r)))
    for i, (x, fired) in enumerate(ended):
        after = names[i + 1] if i + 1 < len(names) else "end"
        t.switches.append(Switch(x, f"{names[i] if i < len(names) else '?'} → {after}"
                                 + (" (condition)" if fired else ""), fired))
    return t


def read_trajectories(store_dir: Path) -> tuple[list[StoreRecord], int]:
    """Every readable record of the store (in index order) and how many lines could not be read."""
    records, bad = [], 0
    for path in sorted(store_dir.glob(SEGMENT_GLOB)):
        with path.open() as fh:
            for line in fh:
                try:
                    r = json.loads(line)
                    records.append(StoreRecord(index=r["index"], step=r["step"], stage=r["stage"],
                                               group=r["group"], source=r["source"], sample=from_json(r["sample"])))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    bad += 1
    return records, bad


def group_key(r: StoreRecord) -> str:
    """Siblings: the samples drawn for one task in one step (ReST and DPO store no group of their own)."""
    return f"{r.stage}|{r.step}|{r.sample.trajectory.task.task_id}"


def breakdowns(records: Sequence[StoreRecord]) -> dict[str, Any]:
    tools: dict[str, Counter] = defaultdict(Counter)  # tool -> {"ok": n, "error": n}
    stops: dict[str, Counter] = defaultdict(Counter)  # stage -> stop reason -> n
    errors: Counter = Counter()
    for r in records:
        t = r.sample.trajectory
        stops[r.stage][t.stop_reason.value] += 1
        if r.sample.reward.masked:
            errors[f"reward masked: {_short(r.sample.reward.reason or 'no reason')}"] += 1
        for turn in t.turns:
            if isinstance(turn.action, ToolCall):
                tools[turn.action.name]["error" if turn.tool_ok is False else "ok"] += 1
                if turn.tool_error:
                    errors[f"tool: {turn.tool_error}"] += 1
            elif isinstance(turn.action, InvalidAction):
                errors[f"invalid action: {_short(turn.action.error)}"] += 1
    return {"tools": {k: dict(v) for k, v in sorted(tools.items())},
            "stops": {k: dict(v) for k, v in stops.items()},
            "errors": dict(errors.most_common())}


def _short(text: str, n: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def entropy_by_step(records: Sequence[StoreRecord]) -> dict[int, float]:
    """Mean -log p of the sampled policy tokens per logged step (the metrics' step, store step + 1): a
    one-sample estimate of the sampling policy's per-token entropy, from the rollouts' own logprobs."""
    total: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    for r in records:
        if r.source != "rollout":
            continue
        t = r.sample.trajectory
        for m, lp in zip(t.loss_mask, t.logprobs):
            if m and math.isfinite(lp):
                total[r.step + 1] -= lp
                count[r.step + 1] += 1
    return {s: total[s] / count[s] for s in sorted(total) if count[s]}


def _turn(turn, process: Sequence[float], i: int) -> dict[str, Any]:
    a = turn.action
    out: dict[str, Any] = {"text": turn.text, "obs": turn.observation, "tool_ok": turn.tool_ok,
                           "tool_error": turn.tool_error, "env_reward": turn.env_reward,
                           "reward": process[i] if i < len(process) else None}
    if isinstance(a, ToolCall):
        out |= {"kind": "tool", "tool": a.name, "args": json.dumps(dict(a.arguments), default=str)}
    elif isinstance(a, FinalAnswer):
        out |= {"kind": "answer", "answer": a.text}
    else:
        out |= {"kind": "invalid", "error": a.error}
    return out


def viewer_records(records: Sequence[StoreRecord], max_records: int) -> tuple[list[dict[str, Any]], set[int]]:
    """Compact records for the viewer (whole sibling groups, spread over the run when there are more than
    `max_records`) and the token ids they use."""
    groups: dict[str, list[StoreRecord]] = defaultdict(list)
    for r in records:
        groups[group_key(r)].append(r)
    keys = list(groups)
    stride = max(1, math.ceil(len(records) / max_records)) if records else 1
    out, ids = [], set()
    for key in keys[::stride]:
        for r in groups[key]:
            s, t = r.sample, r.sample.trajectory
            ids.update(t.token_ids)
            out.append({"id": r.index, "step": r.step + 1, "stage": r.stage, "group": key, "source": r.source,
                        "task": t.task.task_id, "prompt": t.task.prompt, "answer": t.task.answer,
                        "success": s.success, "reward": s.total_reward, "outcome": s.reward.outcome,
                        "masked": s.reward.masked, "reason": s.reward.reason, "stop": t.stop_reason.value,
                        "turns": [_turn(turn, s.reward.process, i) for i, turn in enumerate(t.turns)],
                        "ids": list(t.token_ids), "mask": "".join("1" if m else "0" for m in t.loss_mask),
                        "lp": [round(lp, 3) for lp in t.logprobs]})
    return out, ids
