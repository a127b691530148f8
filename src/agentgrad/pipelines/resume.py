"""Crash-safe resume of a whole run: what a run-state checkpoint holds and how a run is rebuilt from one.

A checkpoint (checkpoint.save_run_state) is written after every `run.checkpoint_every` steps of any stage (a
step whose number is a multiple of it) and at every stage end. It holds the model, optimizer and RNG states and
the `RunState`: the schedule position (stage, step in stage, rolling window), the running stage's own state
(its `state_dict`: BC's sampler and stop rule, RL's KL controller, critic, frozen reference, replay buffer,
success EMA and non-finite count, ReST's sampler, DPO's reference and sampler), and the evals the summary
reports; with them the trajectory store's record count and metrics.jsonl's size. Resuming cuts the store and
metrics back to those offsets, so steps re-run after the checkpoint are recorded exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agentgrad.checkpoint import LATEST, latest_run_state, load_run_state, save_run_state
from agentgrad.config import Config, StageConfig
from agentgrad.data.store import TrajectoryStore
from agentgrad.logging import RunLogger
from agentgrad.pipelines.components import TOOL_HEAD_FILE, Components, build_components
from agentgrad.pipelines.run_state import RunInfo, RunState, ScheduleState
from agentgrad.pipelines.schedule import resume_stage

STAGE_BLOB = "stage"


def truncate_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size > size:
        with path.open("r+b") as fh:
            fh.truncate(size)


class RunCheckpointer:
    """The run's `Save`: a run-state checkpoint after every `every_steps` steps and at every stage end."""

    def __init__(self, run_dir: Path, store: TrajectoryStore, every_steps: int) -> None:
        self.run_dir = run_dir
        self.store = store
        self.every_steps = every_steps

    def __call__(self, c: Components, run: RunState, step: int) -> None:
        """`step`: the number of the step just done, or the global step at a stage end (`run.stage` None)."""
        if self.every_steps and (run.stage is None or step % self.every_steps == 0):
            self.save(c, run, step)

    def save(self, c: Components, run: RunState, step: int) -> None:
        state = {"global_step": step, "schedule": run.schedule.to_dict(), "store_offset": len(self.store),
                 "metrics_offset": (self.run_dir / "metrics.jsonl").stat().st_size, "info": run.info.to_dict(),
                 "lr": c.learner.optimizer.param_groups[0]["lr"]}
        blobs = {STAGE_BLOB: run.stage.state_dict()} if run.stage is not None else {}
        if c.tool_head is not None:  # read back by build_components (model_path=) as tool_head.pt
            blobs[TOOL_HEAD_FILE.removesuffix(".pt")] = c.tool_head.to_blob()
        save_run_state(self.run_dir, step, c.saved_model, c.loaded.tokenizer, c.learner.optimizer, state, blobs)


def can_resume(run_dir: Path) -> bool:
    return (run_dir / "checkpoints" / LATEST).exists()


def resume_run(config: Config, run_dir: Path, store: TrajectoryStore, stages: Sequence[StageConfig],
               logger: RunLogger) -> tuple[Components, RunState]:
    """Rebuild components from checkpoints/LATEST, restore optimizer, RNG and run state, cut store and metrics
    back."""
    directory, saved = latest_run_state(run_dir)
    c = build_components(config, run_dir, model_path=directory, display=logger.display)
    blobs = load_run_state(directory, c.learner.optimizer)
    schedule = ScheduleState.from_dict(saved["schedule"])
    # "rl_state": the name of the running stage's state in checkpoints written before every stage had one
    stage = resume_stage(c, stages, schedule, logger, blobs.get(STAGE_BLOB, blobs.get("rl_state")))
    c.learner.set_lr(saved["lr"])
    store.truncate(saved["store_offset"])
    truncate_file(run_dir / "metrics.jsonl", saved["metrics_offset"])
    return c, RunState(schedule, stage, RunInfo.from_dict(saved["info"]))
