"""Crash-safe resume of a whole run: what a run-state checkpoint holds and how a run is rebuilt from one.

A checkpoint (checkpoint.save_run_state) is written after every `run.checkpoint_every` online-RL steps and at
every stage end. It holds the model, optimizer and RNG states, the schedule state (stage, step in stage), the
RL state (KL controller, critic, frozen reference, replay buffer, success EMA, non-finite count), the
trajectory store's record count and metrics.jsonl's size, and the evals the summary reports. Resuming cuts
the store and metrics back to those offsets, so steps re-run after the checkpoint are recorded exactly once.
BC, ReST and DPO stages are not checkpointed mid-stage: a crash inside one re-runs it from its start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentgrad.checkpoint import LATEST, latest_run_state, load_run_state, save_run_state
from agentgrad.config import Config
from agentgrad.data.store import TrajectoryStore
from agentgrad.pipelines.components import TOOL_HEAD_FILE, Components, build_components
from agentgrad.pipelines.rl import RLState
from agentgrad.pipelines.schedule import ScheduleState


def truncate_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size > size:
        with path.open("r+b") as fh:
            fh.truncate(size)


class RunCheckpointer:
    """The `RunHooks` of a training run: saves run-state checkpoints, and hands a resumed run its RL state."""

    def __init__(self, run_dir: Path, store: TrajectoryStore, every_steps: int) -> None:
        self.run_dir = run_dir
        self.store = store
        self.every_steps = every_steps
        self.schedule_path = run_dir / "schedule_state.json"
        self.info: dict[str, Any] = {}
        """JSON-able facts the summary needs at the end (held-out evals, steps per algorithm)."""
        self.pending_rl: dict[str, Any] | None = None

    def restore_rl(self, state: RLState) -> None:
        if self.pending_rl is not None:
            state.load_state_dict(self.pending_rl)
            self.pending_rl = None

    def after_rl_step(self, c: Components, state: RLState, global_step: int) -> None:
        if self.every_steps and global_step % self.every_steps == 0:
            self.save(c, global_step, ScheduleState.load(self.schedule_path), state)

    def save(self, c: Components, global_step: int, schedule: ScheduleState, rl_state: RLState | None = None) -> None:
        state = {"global_step": global_step, "schedule": schedule.to_dict(), "store_offset": len(self.store),
                 "metrics_offset": (self.run_dir / "metrics.jsonl").stat().st_size, "info": self.info,
                 "lr": c.learner.optimizer.param_groups[0]["lr"]}
        blobs = {"rl_state": rl_state.state_dict()} if rl_state is not None else {}
        if c.tool_head is not None:  # read back by build_components (model_path=) as tool_head.pt
            blobs[TOOL_HEAD_FILE.removesuffix(".pt")] = c.tool_head.to_blob()
        save_run_state(self.run_dir, global_step, c.loaded.model, c.loaded.tokenizer, c.learner.optimizer, state,
                       blobs)


def can_resume(run_dir: Path) -> bool:
    return (run_dir / "checkpoints" / LATEST).exists()


def resume_run(config: Config, run_dir: Path, hooks: RunCheckpointer) -> tuple[Components, ScheduleState]:
    """Rebuild components from checkpoints/LATEST, restore optimizer/RNG/RL state, cut store and metrics back."""
    directory, saved = latest_run_state(run_dir)
    c = build_components(config, run_dir, model_path=directory)
    blobs = load_run_state(directory, c.learner.optimizer)
    c.learner.set_lr(saved["lr"])
    hooks.pending_rl = blobs.get("rl_state")
    hooks.info = saved["info"]
    hooks.store.truncate(saved["store_offset"])
    truncate_file(run_dir / "metrics.jsonl", saved["metrics_offset"])
    schedule = ScheduleState.from_dict(saved["schedule"])
    schedule.save(hooks.schedule_path)
    c.hooks = hooks
    return c, schedule
