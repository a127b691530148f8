"""kill -9 a real `agentgrad train` at named points (AGENTGRAD_KILL_AT), resume it each time, and check that the
stitched-together run equals an uninterrupted one: same per-step metrics, same trajectory store (nothing lost,
nothing duplicated), same final weights."""

import json
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from forked_cli import agentgrad_train

from agentgrad.config import build_config
from agentgrad.data.store import TrajectoryStore
from agentgrad.pipelines.components import build_tiny_model_dir, make_suite
from agentgrad.pipelines.train import train

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"

SHAPE = [
    "env.options={min_operands: 2, max_operands: 2, min_digits: 2, max_digits: 2, operators: '+', result_digits: 2}",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.tiny.intermediate_size=64", "model.tiny.tokenizer_corpus_episodes=50",
    "bc.num_demos=16", "bc.batch_size_episodes=8", "rollout.max_new_tokens_per_turn=32", "rollout.max_turns=2",
    "eval.num_tasks=4", "run.threads=1", "run.checkpoint_every=1", "run.progress=false",
    "reward.name=resume_helpers:token_parity_reward",
]
# A deliberately tiny, fast run that still exercises every piece of RL state: BC, PPO updates with signal
# (token_parity_reward) and a critic, an adaptive KL controller and its frozen reference, replay mixing with IS
# correction, injected tool faults, a checkpoint after every step.
TINY = [
    *SHAPE, "bc.steps=3", "bc.stop_at_success=null",
    "algo.steps=4", "algo.tasks_per_step=2", "algo.group_size=2", "algo.epochs_per_step=2",
    "algo.minibatch_size_episodes=4", "replay.enabled=true", "replay.offline_fraction=0.5",
    "faults.inject_tool_failure_rate=0.3", "algo=ppo", "algo.kl_coef=0.05", "algo.kl_controller=adaptive",
]
# bc, then ReST, then DPO, on a suite whose verifier passes any answer of even length (so an untrained model that
# ends a turn succeeds now and then, and DPO has pairs): BC's sampler and stop rule (a target it cannot reach, so
# it checks every 2 steps and hands on the weights of its best check at its end), ReST's sampler and rising
# threshold, DPO's frozen reference and sampler.
OFFLINE = [
    *SHAPE, "env.name=resume_helpers:EvenAnswerArithmetic", "rollout.max_new_tokens_per_turn=200",
    "schedule.stages=[{algo: bc, steps: 6}, {algo: rest, steps: 2}, {algo: dpo, steps: 2}]",
    "bc.stop_at_success=1.0", "bc.eval_every=2", "bc.eval_tasks=4",
    "rest.tasks_per_iteration=2", "rest.threshold_start=0.3", "rest.samples_per_task=2", "rest.sft_steps=2",
    "rest.batch_size_episodes=4",
    "dpo.tasks_per_iteration=2", "dpo.samples_per_task=8", "dpo.epochs=1", "dpo.batch_size_pairs=4",
]
# The adaptive stage on the suite that passes any even-length answer, its band narrowed to one-step windows so
# that the run switches grpo -> ppo after step 3 and back after step 5 (asserted below): the running algorithm,
# the signal window and the switches live in the schedule's state, the critic (warmed from the first step) in
# the stage's.
ADAPTIVE = [
    *SHAPE, "env.name=resume_helpers:EvenAnswerArithmetic", "rollout.max_new_tokens_per_turn=200",
    "bc.steps=3", "bc.stop_at_success=null", "algo=adaptive", "algo.steps=6", "algo.tasks_per_step=2",
    "algo.group_size=4", "algo.epochs_per_step=2", "algo.minibatch_size_episodes=4", "adaptive.window_steps=1",
    "adaptive.up_at=0.2", "adaptive.down_at=0.1", "adaptive.max_zero_signal=1.0", "adaptive.min_critic_ev=null",
]
# bc, then mcts on the same suite: the value model (a head on the policy's trunk) and its optimizer, the DPO
# reference and the minibatch RNG are the stage's state; the search itself is seeded by the step.
MCTS = [
    *SHAPE, "env.name=resume_helpers:EvenAnswerArithmetic", "rollout.max_new_tokens_per_turn=200",
    "schedule.stages=[{algo: bc, steps: 2}, {algo: mcts, steps: 3}]", "bc.stop_at_success=null",
    "mcts.trees_per_iteration=2", "mcts.simulations=3", "mcts.samples_per_expansion=3", "mcts.top_k=2",
    "mcts.stop_on_success=false", "mcts.value_fit_steps=2", "mcts.value_batch_size=4", "mcts.sft_steps=1",
    "mcts.batch_size_episodes=4", "dpo.epochs=1", "dpo.batch_size_pairs=4",
]
# (kill point, step it fires at): rollout/update/store take the step number of the stage they are in (RL, ReST
# and DPO count on from one stage to the next; BC counts its own), the checkpoint points the number of steps
# done. A kill fires at the first point that matches, and each is followed by `agentgrad train --resume`.
SCENARIOS = {
    "ppo": (TINY, ["rollout:1", "update:1", "store:1", "checkpoint:2", "checkpoint_pointer:2", "after_checkpoint:3"]),
    # BC: in its 5th step's update, in its 5th step's checkpoint (renamed, LATEST not moved), right after its
    # last step's checkpoint (resumed: BC's end and the switch to ReST are still to do); ReST: between Grow and
    # Improve of its 2nd iteration (step 1); DPO: in the first update of its 2nd iteration (step 3).
    "bc-rest-dpo": (OFFLINE, ["update:4", "checkpoint_pointer:5", "after_checkpoint:6", "rollout:1", "update:3"]),
    # BC's steps (3) first; then adaptive: in the rollout of its first ppo step (step 3), in the checkpoint written
    # after the switch back (5 steps done), in the update of the grpo step after it (step 5).
    "adaptive": (ADAPTIVE, ["rollout:3", "checkpoint:5", "update:5"]),
    # mcts: after the search of its 2nd round (step 1), then of its 3rd
    "bc-mcts": (MCTS, ["rollout:1", "rollout:2"]),
}
VOLATILE = ("time", "perf/")


def agentgrad(args: list[str], kill_at: str | None = None,
              environ: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`agentgrad train ARGS` in a process of its own, under `environ` (default: this process's environment)."""
    env = {**(os.environ if environ is None else environ), "PYTHONPATH": f"{SRC}{os.pathsep}{HERE}",
           "HF_HUB_OFFLINE": "1"}
    env.pop("AGENTGRAD_KILL_AT", None)
    if kill_at:
        env["AGENTGRAD_KILL_AT"] = kill_at
    # forked from a server that has the imports done (forked_cli.py): ~1.5 s a start instead of ~7 s
    return agentgrad_train(args, env, timeout=600)


def stable_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def ref_then_killed_run(common: list[str], tmp_path: Path, kills: list[str]) -> Path:
    """`tmp_path/ref` trained uninterrupted, then `tmp_path/killed` killed with -9 at each of `kills` in turn
    (the first start fresh, the others resumed), then resumed to its end; returns the killed run's directory.
    The two runs share nothing but the (read-only) base model, so the killed run's processes run while this
    process trains the ref: each on its one thread (run.threads=1), on a core of its own where there are two."""
    threads = torch.get_num_threads()
    run_dir = tmp_path / "killed"
    environ = dict(os.environ)  # as it is before the ref run starts

    def killed_processes() -> None:
        for i, point in enumerate(kills):
            args = [*common, "run.name=killed"] if i == 0 else ["--resume", str(run_dir)]
            proc = agentgrad(args, kill_at=point, environ=environ)
            assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stderr[-2000:])

    with ThreadPoolExecutor(1) as pool:
        killed = pool.submit(killed_processes)
        train(build_config(overrides=[*common, "run.name=ref"]))  # in-process: one interpreter start less
        killed.result()  # re-raises the thread's failed assert
    train(build_config(overrides=[*common, "run.name=killed"]), run_dir=run_dir, resume=True)
    torch.set_num_threads(threads)
    return run_dir


@pytest.fixture(autouse=True)
def _importable_reward(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_kill_9_at_named_points_then_resume_matches_an_uninterrupted_run(tmp_path, scenario):
    overrides, kills = SCENARIOS[scenario]
    config = build_config(overrides=overrides)
    model = build_tiny_model_dir(config, make_suite(config), tmp_path / "base-model")
    common = [*overrides, f"model.path={model}", f"run.output_dir={tmp_path}"]

    run_dir = ref_then_killed_run(common, tmp_path, kills)
    assert stable_metrics(run_dir) == stable_metrics(tmp_path / "ref")
    killed_store = list(TrajectoryStore(run_dir / "trajectories").raw_records())
    ref_store = list(TrajectoryStore(tmp_path / "ref" / "trajectories").raw_records())
    assert [r["index"] for r in killed_store] == list(range(len(ref_store)))  # none lost, none duplicated
    assert killed_store == ref_store
    from safetensors.torch import load_file

    for tag in ("bc", "final"):
        a = load_file(run_dir / "checkpoints" / tag / "model.safetensors")
        b = load_file(tmp_path / "ref" / "checkpoints" / tag / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), tag
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed"] and summary["final_success_rate"] == json.loads(
        (tmp_path / "ref" / "summary.json").read_text())["final_success_rate"]
    if scenario == "adaptive":  # both switches, restored from checkpoints into the killed run's summary
        assert [(w["algo"], w["to_algo"], w["at_step"]) for w in summary["stage_switches"]
                if w["from_stage"] == w["to_stage"]] == [("grpo", "ppo", 3), ("ppo", "grpo", 5)]
    if scenario == "bc-rest-dpo":  # the run is the one the comments above describe
        rows = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
        by_stage = {stage: {r["step"]: r for r in rows if r["stage"] == stage} for stage in ("bc", "rest", "dpo")}
        assert [s for s, r in by_stage["bc"].items() if "eval/bc_validation_success" in r] == [2, 4, 6]
        assert all(r["rest/kept_fraction"] > 0 for r in by_stage["rest"].values())
        assert by_stage["dpo"][4]["train/updates"] > 0  # the iteration killed in its update
