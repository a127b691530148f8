"""`agentgrad train`: the stages (BC warm-up, then RL/ReST/DPO, or a schedule), held-out evals, summary.json."""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import datetime
from pathlib import Path

from agentgrad.checkpoint import save_checkpoint
from agentgrad.config import Config, StageConfig, save_config
from agentgrad.data.store import TrajectoryStore
from agentgrad.logging import JsonlSink, ProgressDisplay, RunLogger
from agentgrad.pipelines.components import Components, build_components
from agentgrad.pipelines.evaluate import EvalResult, evaluate
from agentgrad.pipelines.schedule import run_schedule, stages_of


def make_run_dir(config: Config) -> Path:
    name = config.run.name or datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(config.run.output_dir) / name
    if (run_dir / "summary.json").exists():
        raise FileExistsError(f"{run_dir} already holds a finished run; pick another run.name")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def held_out(c: Components) -> EvalResult:
    e = c.config.eval
    return evaluate(c.policy, c.codec, c.suite, c.limits, num_tasks=e.num_tasks, seed=c.config.run.seed,
                    temperature=e.temperature, batch_size=e.batch_size)


def checkpoint(c: Components, run_dir: Path, tag: str) -> Path:
    return save_checkpoint(run_dir / "checkpoints" / tag, c.loaded.model, c.loaded.tokenizer, c.learner.optimizer)


def train(config: Config, *, run_dir: Path | None = None) -> dict:
    """Run the stages (`schedule.stages`, or bc then `algo.name`), with held-out evals after the leading BC
    stages and at the end. The schedule's state is kept in `schedule_state.json`."""
    run_dir = run_dir or make_run_dir(config)
    save_config(config, run_dir / "config.yaml")
    started = time.perf_counter()
    display = ProgressDisplay(enabled=config.run.progress)
    logger = RunLogger([JsonlSink(run_dir / "metrics.jsonl")], display)
    stages = stages_of(config)
    leading_bc = next((i for i, s in enumerate(stages) if s.algo != "bc"), len(stages))
    evals: dict[str, EvalResult] = {}
    steps_by_algo: dict[str, int] = {}

    def report(tag: str, step: int, label: str) -> None:
        evals[tag] = result = held_out(c)
        logger.log(step, f"eval_{tag}", {"eval/success_rate": result.success_rate})
        display.print(f"held-out success after {label}: {result.success_rate:.1%} "
                      f"(95% CI {result.ci_low:.1%}-{result.ci_high:.1%}, n={result.num_tasks})")

    def on_stage_end(index: int, stage: StageConfig, steps: int) -> None:
        steps_by_algo[stage.algo] = steps_by_algo.get(stage.algo, 0) + steps
        if stage.algo == "bc":
            checkpoint(c, run_dir, "bc")
        if index == leading_bc - 1:
            report("bc", steps, "BC")

    try:
        c = build_components(config, run_dir)
        if leading_bc == 0:
            report("bc", 0, "the start")
        state = run_schedule(c, logger, stages, store=TrajectoryStore(run_dir / "trajectories" / "rl.jsonl"),
                             state_path=run_dir / "schedule_state.json", on_stage_end=on_stage_end)
        checkpoint(c, run_dir, "final")
        if leading_bc == len(stages):  # BC only: the model has not changed since the BC eval
            evals["final"] = evals["bc"]
        else:
            report("final", state.global_step, "+".join(s.algo for s in stages[leading_bc:]).upper())
    finally:
        logger.close()
    initial, final = evals["bc"], evals["final"]
    summary = {"run_dir": str(run_dir), "initial_success_rate": initial.success_rate,
               "final_success_rate": final.success_rate, "initial_eval": initial.to_dict(),
               "final_eval": final.to_dict(), "wall_time_s": round(time.perf_counter() - started, 1),
               "bc_steps": steps_by_algo.get("bc", 0), "rl_steps": state.global_step,
               "algorithm": "+".join(s.algo for s in stages),
               "stage_switches": [dataclasses.asdict(w) for w in state.switches]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
