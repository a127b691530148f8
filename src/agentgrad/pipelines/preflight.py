"""Checks a command runs before it builds a model: bad input fails in a second, with one line, and touches no file.

`preflight(config)` checks model.path (a local path first: a missing directory is not a hub id), then builds the
task suite and the reward exactly as the run will (unknown names, options, a task file that is missing or has a
broken line, a reward module that does not import, a judge without a passing calibration). `check_fresh_run`
and `check_resumable` guard the data of an existing run directory. Each raises `BadInputError` with a one-line
message; `agentgrad` prints it as `error: ...` and exits 2. No torch here, so that failing is fast.
"""

from __future__ import annotations

from pathlib import Path

from agentgrad.config import Config

LATEST = "LATEST"  # checkpoints/LATEST of a run with a run-state checkpoint (as agentgrad.checkpoint writes it)


class BadInputError(ValueError):
    """A command's input cannot work; the message (one line) says what and how to fix it."""


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def check_model_path(path: str | None) -> None:
    if not path:
        return
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise BadInputError(f"could not load model.path {path!r}: a file, not a model directory")
        if not (p / "config.json").is_file():
            raise BadInputError(f"could not load model.path {path!r}: no config.json in it (empty or not saved by "
                                "save_pretrained); leave model.path empty to build the tiny model")
        return
    # A hub id is `name` or `org/name`; anything else that does not exist is a local path that is missing.
    if p.is_absolute() or path.startswith((".", "~")) or path.count("/") > 1 or "\\" in path:
        raise BadInputError(f"could not load model.path {path!r}: no such directory")


def check_sinks(names: list[str]) -> None:
    from agentgrad.sinks import missing_packages

    missing = missing_packages(names)
    if missing:
        what = ", ".join(f"{sink} needs the {module!r} package" for sink, module in missing)
        raise BadInputError(f"metrics.sinks: {what}; install them with pip install 'agentgrad[sinks]'")


def check_rollout_backend(config: Config) -> None:
    """rollout.backend=ray needs Ray installed, and runs token action heads only."""
    r = config.rollout
    if r.backend != "ray":
        return
    import importlib.util

    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:  # origin None: a bare directory named ray (e.g. Ray's /tmp/ray)
        raise BadInputError("rollout.backend=ray needs Ray: pip install 'agentgrad[ray]' (or leave rollout.backend "
                            "at local: rollouts in this process)")
    if r.action_head != "tokens":
        raise BadInputError("rollout.backend=ray runs rollout.action_head=tokens only (the factored head's draws "
                            "are keyed by the worker's own rows)")


SHARDED_STAGES = ("bc", "grpo", "rloo", "reinforce_pp", "ppo", "adaptive", "dpo")


def check_learner(config: Config) -> None:
    """learner.*: combinations a sharded learner cannot run, each as one line."""
    import importlib.util

    learner = config.learner
    if learner.backend == "torch":
        if learner.world_size > 1:
            raise BadInputError(f"learner.world_size={learner.world_size} with learner.backend=torch (one process): "
                                "set learner.backend=fsdp or learner.backend=deepspeed")
        return
    name = f"learner.backend={learner.backend}"
    if learner.backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise BadInputError(f"{name} needs DeepSpeed: pip install 'agentgrad[deepspeed]'")
    unsupported = [
        (config.model.lora.r > 0, "model.lora.r > 0 (LoRA): use learner.backend=torch"),
        (config.rollout.action_head != "tokens",
         f"rollout.action_head={config.rollout.action_head}: use rollout.action_head=tokens"),
        (config.rollout.backend != "local", f"rollout.backend={config.rollout.backend}: use rollout.backend=local"),
        (config.model.compute_dtype != "fp32",
         f"model.compute_dtype={config.model.compute_dtype} (sharded learners run fp32): set it to fp32"),
        (config.rollout.max_staleness > 0, "rollout.max_staleness > 0: set it to 0"),
    ]
    algos = [s.algo for s in config.schedule.stages] or ["bc", config.algo.name]
    unsupported += [(a not in SHARDED_STAGES, f"the {a} stage: sharded runs take {', '.join(SHARDED_STAGES)}")
                    for a in algos]
    for bad, what in unsupported:
        if bad:
            raise BadInputError(f"{name} does not support {what}")


def preflight(config: Config) -> None:
    from agentgrad.envs import SUITES
    from agentgrad.rewards.base import load_reward

    check_model_path(config.model.path)
    check_sinks(config.metrics.sinks)
    check_rollout_backend(config)
    check_learner(config)
    try:  # a registered name, a `module:attr` import path or an entry point (UnknownNameError, ImportRefError)
        factory = SUITES.get(config.env.name)
    except (KeyError, ValueError) as exc:
        raise BadInputError(f"env.name: {one_line(exc)}") from None
    try:
        suite = factory(**config.env.options)
    except Exception as exc:  # a suite (maybe a plug-in) rejecting its options: TypeError, ValueError, OSError...
        raise BadInputError(f"env {config.env.name!r} with options {config.env.options}: {one_line(exc)}") from None
    try:
        load_reward(config.reward.name, suite, **config.reward.options)
    except Exception as exc:  # unknown name, a module that does not import (any error), an uncalibrated judge
        raise BadInputError(f"reward {config.reward.name!r}: {one_line(exc)}") from None
    check_advantage_estimator(config.algo.advantage_estimator)


def check_advantage_estimator(name: str | None) -> None:
    from agentgrad.algos.advantages import ADVANTAGE_ESTIMATORS

    if name is None:
        return
    try:
        estimator = ADVANTAGE_ESTIMATORS.get(name)
    except Exception as exc:  # unknown name, a module that does not import
        raise BadInputError(f"algo.advantage_estimator: {one_line(exc)}") from None
    if not callable(estimator):
        raise BadInputError(f"algo.advantage_estimator: {name!r} is not callable")


def _has_data(run_dir: Path) -> bool:
    trajectories = run_dir / "trajectories"
    metrics = run_dir / "metrics.jsonl"
    return ((metrics.exists() and metrics.stat().st_size > 0)
            or (trajectories.is_dir() and any(f.stat().st_size for f in trajectories.iterdir() if f.is_file())))


def check_fresh_run(run_dir: Path) -> None:
    """A new run must not reuse the directory of an earlier one (starting over would truncate its data)."""
    if (run_dir / "config.yaml").exists() or _has_data(run_dir):
        raise BadInputError(f"{run_dir} already holds a run; continue it with `agentgrad train --resume {run_dir}` "
                            "or pick another run.name")


def check_resumable(run_dir: Path, saved_checkpoint_every: int) -> None:
    """`--resume` needs a run-state checkpoint, unless the run has written nothing worth keeping yet. A run
    saved with run.checkpoint_every=0 never writes one mid-run, so a restart would discard what it has."""
    if (run_dir / "checkpoints" / LATEST).exists() or saved_checkpoint_every > 0 or not _has_data(run_dir):
        return
    raise BadInputError(f"{run_dir} has no run-state checkpoint to resume from (it ran with run.checkpoint_every=0):"
                        " resuming would restart it and discard its trajectories and metrics; start a new run with "
                        "another run.name (and run.checkpoint_every=N to make it resumable)")
