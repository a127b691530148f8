"""`agentgrad train`: BC warm-up, held-out eval, online RL, held-out eval, summary.json.

With run.checkpoint_every > 0 the RL stage writes resumable run-state checkpoints (checkpoints/step-N, named by
checkpoints/LATEST), and `train(config, run_dir=..., resume=True)` continues from the last one: the model,
optimizer, RNGs, RL state (replay buffer, success EMA, fault counters) are restored, and the trajectory store
and metrics.jsonl are cut back to what that checkpoint had seen, so re-run steps are recorded exactly once.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

from agentgrad.checkpoint import LATEST, latest_run_state, load_run_state, save_checkpoint, save_run_state
from agentgrad.config import Config, save_config
from agentgrad.data.store import TrajectoryStore
from agentgrad.logging import JsonlSink, ProgressDisplay, RunLogger
from agentgrad.pipelines.bc import run_bc
from agentgrad.pipelines.components import Components, build_components
from agentgrad.pipelines.evaluate import EvalResult, evaluate
from agentgrad.pipelines.rl import RLState, initial_state, run_rl


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


def truncate_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size > size:
        with path.open("r+b") as fh:
            fh.truncate(size)


def run_state_saver(c: Components, run_dir: Path, store: TrajectoryStore, stage_info: dict):
    """The `save` callback of run_rl: everything a resumed run needs, written atomically."""
    def save(state: RLState) -> None:
        extra = {"stage": "rl", "lr": c.config.algo.lr, "store_offset": len(store),
                 "metrics_offset": (run_dir / "metrics.jsonl").stat().st_size, "kl": {}, **stage_info}
        save_run_state(run_dir, state.step, c.loaded.model, c.loaded.tokenizer, c.learner.optimizer,
                       {**extra, "rl": state.to_json()},
                       replay=state.replay.state_dict() if state.replay is not None else None)
    return save


def resume_components(config: Config, run_dir: Path) -> tuple[Components, RLState, dict]:
    """Rebuild the run from checkpoints/LATEST; cut the store and metrics back to that checkpoint."""
    directory, saved = latest_run_state(run_dir)
    c = build_components(config, run_dir, model_path=directory)
    replay = load_run_state(directory, c.learner.optimizer)
    state = initial_state(c)
    state.restore(saved["rl"], replay)
    TrajectoryStore(run_dir / "trajectories").truncate(saved["store_offset"])
    truncate_file(run_dir / "metrics.jsonl", saved["metrics_offset"])
    return c, state, saved


def load_reference(config: Config, run_dir: Path):
    if config.algo.kl_coef <= 0:
        return None
    from agentgrad.models.hf import load_model

    return load_model(run_dir / "checkpoints" / "bc", dtype=config.model.dtype,
                      device=config.model.device).model.eval().requires_grad_(False)


def train(config: Config, *, run_dir: Path | None = None, resume: bool = False) -> dict:
    run_dir = run_dir or make_run_dir(config)
    if resume and not (run_dir / "checkpoints" / LATEST).exists():
        resume = False  # killed before the first run-state checkpoint (during BC): start over in the same dir
        truncate_file(run_dir / "metrics.jsonl", 0)
        TrajectoryStore(run_dir / "trajectories").truncate(0)
    if not resume:
        save_config(config, run_dir / "config.yaml")
    started = time.perf_counter()
    display = ProgressDisplay(enabled=config.run.progress)
    try:
        if resume:
            c, state, saved = resume_components(config, run_dir)
            logger = RunLogger([JsonlSink(run_dir / "metrics.jsonl")], display)
            bc_steps, initial = saved["bc_steps"], saved["initial_eval"]
            reference = load_reference(config, run_dir)
        else:
            logger = RunLogger([JsonlSink(run_dir / "metrics.jsonl")], display)
            c = build_components(config, run_dir)
            bc_steps = run_bc(c, logger)
            checkpoint(c, run_dir, "bc")
            result = held_out(c)
            initial = result.to_dict()
            logger.log(bc_steps, "eval_bc", {"eval/success_rate": result.success_rate})
            display.print(f"held-out success after BC: {result.success_rate:.1%} "
                          f"(95% CI {result.ci_low:.1%}-{result.ci_high:.1%}, n={result.num_tasks})")
            state, reference = initial_state(c), None
        store = TrajectoryStore(run_dir / "trajectories")
        save = run_state_saver(c, run_dir, store, {"bc_steps": bc_steps, "initial_eval": initial})
        if not resume and config.run.checkpoint_every:
            save(state)  # resumable from the start of RL: a crash in step 0 does not redo BC
        run_rl(c, logger, store, state=state, reference=reference, save=save)
        checkpoint(c, run_dir, "final")
        final = held_out(c)
        logger.log(config.algo.steps, "eval_final", {"eval/success_rate": final.success_rate})
        display.print(f"held-out success after {config.algo.name.upper()}: {final.success_rate:.1%} "
                      f"(95% CI {final.ci_low:.1%}-{final.ci_high:.1%}, n={final.num_tasks})")
    finally:
        if "logger" in locals():
            logger.close()
    summary = {"run_dir": str(run_dir), "initial_success_rate": initial["success_rate"],
               "final_success_rate": final.success_rate, "initial_eval": initial,
               "final_eval": final.to_dict(), "wall_time_s": round(time.perf_counter() - started, 1),
               "bc_steps": bc_steps, "rl_steps": config.algo.steps, "algorithm": config.algo.name,
               "resumed": resume}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
