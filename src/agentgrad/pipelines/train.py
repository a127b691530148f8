"""`agentgrad train`: BC warm-up, held-out eval, online RL, held-out eval, summary.json."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

from agentgrad.checkpoint import save_checkpoint
from agentgrad.config import Config, save_config
from agentgrad.data.store import TrajectoryStore
from agentgrad.logging import JsonlSink, ProgressDisplay, RunLogger
from agentgrad.pipelines.bc import run_bc
from agentgrad.pipelines.components import Components, build_components
from agentgrad.pipelines.evaluate import EvalResult, evaluate
from agentgrad.pipelines.rl import run_rl


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
    run_dir = run_dir or make_run_dir(config)
    save_config(config, run_dir / "config.yaml")
    started = time.perf_counter()
    display = ProgressDisplay(enabled=config.run.progress)
    logger = RunLogger([JsonlSink(run_dir / "metrics.jsonl")], display)
    try:
        c = build_components(config, run_dir)
        bc_steps = run_bc(c, logger)
        checkpoint(c, run_dir, "bc")
        initial = held_out(c)
        logger.log(bc_steps, "eval_bc", {"eval/success_rate": initial.success_rate})
        display.print(f"held-out success after BC: {initial.success_rate:.1%} "
                      f"(95% CI {initial.ci_low:.1%}-{initial.ci_high:.1%}, n={initial.num_tasks})")
        run_rl(c, logger, TrajectoryStore(run_dir / "trajectories" / "rl.jsonl"))
        checkpoint(c, run_dir, "final")
        final = held_out(c)
        logger.log(config.algo.steps, "eval_final", {"eval/success_rate": final.success_rate})
        display.print(f"held-out success after {config.algo.name.upper()}: {final.success_rate:.1%} "
                      f"(95% CI {final.ci_low:.1%}-{final.ci_high:.1%}, n={final.num_tasks})")
    finally:
        logger.close()
    summary = {"run_dir": str(run_dir), "initial_success_rate": initial.success_rate,
               "final_success_rate": final.success_rate, "initial_eval": initial.to_dict(),
               "final_eval": final.to_dict(), "wall_time_s": round(time.perf_counter() - started, 1),
               "bc_steps": bc_steps, "rl_steps": config.algo.steps, "algorithm": config.algo.name}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
