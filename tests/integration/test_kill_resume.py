"""kill -9 a real `agentgrad train` at named points (AGENTGRAD_KILL_AT), resume it each time, and check that the
stitched-together run equals an uninterrupted one: same per-step metrics, same trajectory store (nothing lost,
nothing duplicated), same final weights."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentgrad.config import build_config
from agentgrad.data.store import TrajectoryStore
from agentgrad.pipelines.components import build_tiny_model_dir, make_suite
from agentgrad.pipelines.train import train

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"

# A deliberately tiny, fast run that still exercises every piece of state: BC, PPO updates with signal
# (token_parity_reward) and a critic, an adaptive KL controller and its frozen reference, replay mixing with IS
# correction, injected tool faults, a checkpoint after every step.
TINY = [
    "env.options={min_operands: 2, max_operands: 2, min_digits: 2, max_digits: 2, operators: '+', result_digits: 2}",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.tiny.intermediate_size=64", "model.tiny.tokenizer_corpus_episodes=50",
    "bc.steps=3", "bc.stop_at_success=null", "bc.num_demos=16", "bc.batch_size_episodes=8",
    "algo.steps=4", "algo.tasks_per_step=2", "algo.group_size=2", "algo.epochs_per_step=2",
    "algo.minibatch_size_episodes=4", "rollout.max_new_tokens_per_turn=32", "rollout.max_turns=2",
    "eval.num_tasks=4", "run.threads=1", "run.checkpoint_every=1", "run.progress=false",
    "replay.enabled=true", "replay.offline_fraction=0.5", "faults.inject_tool_failure_rate=0.3",
    "reward.name=resume_helpers:token_parity_reward", "algo=ppo", "algo.kl_coef=0.05", "algo.kl_controller=adaptive",
]
# (kill point, step it fires at): rollout/update/store take the RL step index, the checkpoint points the
# number of steps completed. Each kill is followed by `agentgrad train --resume`.
KILLS = ["rollout:1", "update:1", "store:1", "checkpoint:2", "checkpoint_pointer:2", "after_checkpoint:3"]
VOLATILE = ("time", "perf/")


def agentgrad(args: list[str], kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{HERE}", "HF_HUB_OFFLINE": "1"}
    env.pop("AGENTGRAD_KILL_AT", None)
    if kill_at:
        env["AGENTGRAD_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "agentgrad.cli", "train", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def stable_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.fixture(autouse=True)
def _importable_reward(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


@pytest.mark.slow
def test_kill_9_at_six_points_then_resume_matches_an_uninterrupted_run(tmp_path):
    config = build_config(overrides=TINY)
    model = build_tiny_model_dir(config, make_suite(config), tmp_path / "base-model")
    common = [*TINY, f"model.path={model}", f"run.output_dir={tmp_path}"]

    threads = torch.get_num_threads()
    train(build_config(overrides=[*common, "run.name=ref"]))  # in-process: one interpreter start less

    run_dir = tmp_path / "killed"
    for i, point in enumerate(KILLS):
        args = [*common, "run.name=killed"] if i == 0 else ["--resume", str(run_dir)]
        proc = agentgrad(args, kill_at=point)
        assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stderr[-2000:])
    train(build_config(overrides=[*common, "run.name=killed"]), run_dir=run_dir, resume=True)
    torch.set_num_threads(threads)

    assert stable_metrics(run_dir) == stable_metrics(tmp_path / "ref")
    killed_store = [r for r in TrajectoryStore(run_dir / "trajectories").raw_records()]
    ref_store = [r for r in TrajectoryStore(tmp_path / "ref" / "trajectories").raw_records()]
    assert [r["index"] for r in killed_store] == list(range(len(ref_store)))  # none lost, none duplicated
    assert killed_store == ref_store
    from safetensors.torch import load_file

    a = load_file(run_dir / "checkpoints" / "final" / "model.safetensors")
    b = load_file(tmp_path / "ref" / "checkpoints" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed"] and summary["final_success_rate"] == json.loads(
        (tmp_path / "ref" / "summary.json").read_text())["final_success_rate"]
