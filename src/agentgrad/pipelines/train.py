"""`agentgrad train`: the stages (BC warm-up, then RL/ReST/DPO, or a schedule), held-out evals, summary.json.

With run.checkpoint_every > 0, run-state checkpoints (pipelines/resume.py) make a run resumable after a crash, in
the middle of any stage: `train(config, run_dir=..., resume=True)` (`agentgrad train --resume RUN_DIR`) continues
from the last one.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from agentgrad.checkpoint import save_checkpoint
from agentgrad.config import Config, StageConfig, load_config, save_config
from agentgrad.data.store import TrajectoryStore
from agentgrad.envs import close_suite
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines.components import TOOL_HEAD_FILE, Components, build_components
from agentgrad.pipelines.evaluate import EvalResult, evaluate
from agentgrad.pipelines.preflight import check_fresh_run, check_resumable
from agentgrad.pipelines.resume import RunCheckpointer, can_resume, resume_run, truncate_file
from agentgrad.pipelines.rollout_backend import close_rollout
from agentgrad.pipelines.run_state import RunState
from agentgrad.pipelines.schedule import run_schedule, stages_of
from agentgrad.sinks import SinkContext, make_sinks


def make_run_dir(config: Config) -> Path:
    name = config.run.name or datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(config.run.output_dir) / name
    check_fresh_run(run_dir)  # starting over in an earlier run's directory would truncate its data
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def held_out(c: Components, display: ProgressDisplay | None = None) -> EvalResult:
    e = c.config.eval
    display = display or ProgressDisplay(enabled=False)
    with display.track("held-out eval", e.num_tasks) as progress:
        return evaluate(c.policy, c.codec, c.suite, c.limits, c.sampler, num_tasks=e.num_tasks,
                        seed=c.config.run.seed, temperature=e.temperature, batch_size=e.batch_size, progress=progress)


def checkpoint(c: Components, run_dir: Path, tag: str) -> Path:
    extra = {TOOL_HEAD_FILE: c.tool_head.save} if c.tool_head is not None else None
    return save_checkpoint(run_dir / "checkpoints" / tag, c.saved_model, c.loaded.tokenizer, c.learner.optimizer,
                           extra)


def start_or_resume(config: Config, run_dir: Path, resume: bool, store: TrajectoryStore,
                    stages: Sequence[StageConfig], display: ProgressDisplay) -> tuple[Components, RunState]:
    if resume and can_resume(run_dir):
        return resume_run(config, run_dir, store, stages, RunLogger([], display))
    # A fresh run, or one killed before its first checkpoint (inside its first stage): start over.
    truncate_file(run_dir / "metrics.jsonl", 0)
    store.truncate(0)
    return build_components(config, run_dir, display=display), RunState()


def train(config: Config, *, run_dir: Path | None = None, resume: bool = False) -> dict:
    """Run the stages (`schedule.stages`, or bc then `algo.name`), with held-out evals after the leading BC
    stages and at the end. The run's state is one `RunState`, returned by every stage and saved by
    `RunCheckpointer` after every step (when run.checkpoint_every says so)."""
    if resume and run_dir is not None and (run_dir / "config.yaml").exists():
        check_resumable(run_dir, load_config(run_dir / "config.yaml").run.checkpoint_every)
    run_dir = run_dir or make_run_dir(config)
    if not (resume and (run_dir / "config.yaml").exists()):
        save_config(config, run_dir / "config.yaml")
    started = time.perf_counter()
    display = ProgressDisplay(enabled=config.run.progress)
    store = TrajectoryStore(run_dir / "trajectories")
    stages = stages_of(config)
    c, run = start_or_resume(config, run_dir, resume, store, stages, display)
    m = config.metrics
    logger = RunLogger(make_sinks(m.sinks, SinkContext(run_dir, run_dir.name, m.model_dump(), config.to_dict())),
                       display)
    leading_bc = next((i for i, s in enumerate(stages) if s.algo != "bc"), len(stages))

    def report(run: RunState, tag: str, step: int, label: str) -> RunState:
        result = held_out(c, display)
        logger.log(step, f"eval_{tag}", {"eval/success_rate": result.success_rate})
        display.print(f"held-out success after {label}: {result.success_rate:.1%} "
                      f"(95% CI {result.ci_low:.1%}-{result.ci_high:.1%}, n={result.num_tasks})")
        for line in (result.kinds_line(), result.note):
            if line:
                display.print(line)
        return dataclasses.replace(run, info=run.info.with_eval(tag, result.to_dict()))

    def on_stage_end(run: RunState, index: int, stage: StageConfig, steps: int) -> RunState:
        run = dataclasses.replace(run, info=run.info.with_steps(stage.algo, steps))
        if stage.algo == "bc":
            checkpoint(c, run_dir, "bc")
        if index == leading_bc - 1:
            run = report(run, "bc", steps, "BC")
        return run

    try:
        if leading_bc == 0 and "bc" not in run.info.evals:
            run = report(run, "bc", 0, "the start")
        run = run_schedule(c, logger, stages, run, store=store,
                           save=RunCheckpointer(run_dir, store, config.run.checkpoint_every),
                           on_stage_end=on_stage_end)
        checkpoint(c, run_dir, "final")
        if leading_bc == len(stages):  # BC only: the model has not changed since the BC eval
            run = dataclasses.replace(run, info=run.info.with_eval("final", run.info.evals["bc"]))
        else:
            run = report(run, "final", run.schedule.global_step, "+".join(s.algo for s in stages[leading_bc:]).upper())
    finally:
        logger.close()
        close_suite(c.suite)  # its sandbox pool, its MCP servers
        close_rollout(c)  # Ray rollout workers, a vLLM engine or server
        if hasattr(c.learner, "stop"):  # a sharded learner: its other ranks leave their loop
            c.learner.stop()
    initial, final = run.info.evals["bc"], run.info.evals["final"]
    summary = {"run_dir": str(run_dir), "initial_success_rate": initial["success_rate"],
               "final_success_rate": final["success_rate"], "initial_eval": initial,
               "final_eval": final, "wall_time_s": round(time.perf_counter() - started, 1),
               "bc_steps": run.info.steps_by_algo.get("bc", 0), "rl_steps": run.schedule.global_step,
               "algorithm": "+".join(s.algo for s in stages), "resumed": resume,
               "stage_switches": [dataclasses.asdict(w) for w in run.schedule.switches]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
