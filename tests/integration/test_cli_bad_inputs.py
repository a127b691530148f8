"""Bad input through the real CLI: a non-zero exit, exactly one line, starting `error:`, no traceback, and no file
of an existing run directory changed (hashed before and after). Also: a run's directory is never reused by a
fresh run, and `--resume` never silently starts over a run that has no run-state checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _agentgrad(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the reward-module case imports a module from cwd
    return subprocess.run([sys.executable, "-m", "agentgrad.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)


def _tree_hash(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def assert_one_error_line(out: subprocess.CompletedProcess, *needles: str) -> str:
    assert out.returncode != 0, out
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture()
def world(tmp_path):
    """runs/existing: an earlier run's directory (config, metrics, trajectories, a checkpoint), and
    runs/broken: one whose config.yaml is not valid YAML. The whole runs/ tree is hashed around each command."""
    from agentgrad.config import build_config, save_config

    runs = tmp_path / "runs"
    existing = runs / "existing"
    (existing / "trajectories").mkdir(parents=True)
    (existing / "checkpoints" / "bc").mkdir(parents=True)
    save_config(build_config(overrides=[f"run.output_dir={runs}", "run.name=existing"]), existing / "config.yaml")
    (existing / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/success_rate": 0.5}) + "\n")
    (existing / "trajectories" / "part-00000.jsonl").write_text('{"record": 1}\n')
    (existing / "checkpoints" / "bc" / "model.safetensors").write_bytes(b"\0" * 64)
    broken = runs / "broken"
    broken.mkdir()
    (broken / "config.yaml").write_text("run:\n  name: broken\n  seed: [1, 2\n")
    (broken / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _tree_hash(runs)
    yield tmp_path, runs
    assert _tree_hash(runs) == before, "a file under runs/ was created or changed"


def _fresh(runs: Path) -> list[str]:
    return [f"run.output_dir={runs}", "run.name=fresh", "run.progress=false"]


# ---- broken YAML --------------------------------------------------------------------------------------------


def test_broken_yaml_in_a_preset(world):
    cwd, runs = world
    (cwd / "preset.yaml").write_text("algo:\n  lr: [0.1\n")
    assert_one_error_line(_agentgrad("train", "--preset", str(cwd / "preset.yaml"), *_fresh(runs), cwd=cwd),
                          "preset.yaml", "not valid YAML", "line")


def test_broken_yaml_in_an_override(world):
    cwd, runs = world
    assert_one_error_line(_agentgrad("train", "algo.lr=[0.1", *_fresh(runs), cwd=cwd), "algo.lr", "not valid YAML")


def test_broken_yaml_in_a_runs_config_on_resume(world):
    cwd, runs = world
    assert_one_error_line(_agentgrad("train", "--resume", str(runs / "broken"), cwd=cwd), "config.yaml",
                          "not valid YAML")


def test_broken_yaml_in_a_runs_config_on_eval(world):
    cwd, runs = world
    assert_one_error_line(_agentgrad("eval", str(runs / "broken"), cwd=cwd), "config.yaml", "not valid YAML")


# ---- model, tasks, env, reward --------------------------------------------------------------------------------


def test_model_path_that_is_an_empty_directory(world):
    cwd, runs = world
    (cwd / "empty-model").mkdir()
    assert_one_error_line(_agentgrad("train", f"model.path={cwd / 'empty-model'}", *_fresh(runs), cwd=cwd),
                          "empty-model", "config.json")


def test_model_path_that_does_not_exist_is_checked_as_a_local_path(world):
    cwd, runs = world
    line = assert_one_error_line(_agentgrad("train", f"model.path={cwd / 'no' / 'such-model'}", *_fresh(runs),
                                            cwd=cwd), "no such directory")
    assert "Repo id" not in line


def test_jsonl_task_file_that_is_missing(world):
    cwd, runs = world
    assert_one_error_line(_agentgrad("train", "env=jsonl", f"env.options.path={cwd / 'tasks.jsonl'}", *_fresh(runs),
                                     cwd=cwd), "tasks.jsonl", "does not exist")


def test_jsonl_task_file_with_a_broken_line(world):
    cwd, runs = world
    good = json.dumps({"task_id": "t1", "prompt": "What is 1 + 1?", "answer": "2"})
    (cwd / "tasks.jsonl").write_text(good + "\n" + '{"task_id": "t2", "prompt": \n')
    assert_one_error_line(_agentgrad("train", "env=jsonl", f"env.options.path={cwd / 'tasks.jsonl'}", *_fresh(runs),
                                     cwd=cwd), "tasks.jsonl:2", "not JSON")


def test_unknown_env_option(world):
    cwd, runs = world
    assert_one_error_line(_agentgrad("train", "env.options.no_such_option=3", *_fresh(runs), cwd=cwd),
                          "no_such_option")


def test_unknown_suite(world):
    cwd, runs = world
    assert_one_error_line(_agentgrad("train", "env=no-such-suite", *_fresh(runs), cwd=cwd), "no-such-suite",
                          "arithmetic")


def test_unknown_reward(world):
    cwd, runs = world
    assert_one_error_line(_agentgrad("train", "reward=no_such_reward", *_fresh(runs), cwd=cwd), "no_such_reward",
                          "outcome")


def test_reward_module_that_does_not_import(world):
    cwd, runs = world
    (cwd / "my_broken_reward.py").write_text("import math\nraise RuntimeError('the module itself is broken')\n")
    assert_one_error_line(_agentgrad("train", "reward.name=my_broken_reward:reward", *_fresh(runs), cwd=cwd),
                          "my_broken_reward", "broken")


def test_judge_without_a_passing_calibration(world):
    cwd, runs = world
    assert_one_error_line(_agentgrad("train", "reward=judge", "reward.options.base_url=http://127.0.0.1:9",
                                     "reward.options.model=judge-model", *_fresh(runs), cwd=cwd), "calibrat")


# ---- the data of an existing run ------------------------------------------------------------------------------


def test_same_run_name_without_resume_refuses(world):
    cwd, runs = world
    assert_one_error_line(_agentgrad("train", f"run.output_dir={runs}", "run.name=existing", cwd=cwd),
                          "--resume", str(runs / "existing"), "run.name")


def test_resume_without_a_run_state_checkpoint_refuses(world):
    cwd, runs = world
    assert_one_error_line(_agentgrad("train", "--resume", str(runs / "existing"), cwd=cwd),
                          "run.checkpoint_every=0", "discard")


@pytest.mark.skipif(os.geteuid() != 0, reason="a real full disk needs a tmpfs mount (root)")
def test_disk_full_while_writing_a_checkpoint(tmp_path, tiny_model_dir):
    disk = tmp_path / "small-disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        out = _agentgrad("train", f"model.path={tiny_model_dir}", "bc.steps=1", "bc.num_demos=4",
                         "bc.batch_size_episodes=2", "bc.stop_at_success=null", "algo.steps=1", "eval.num_tasks=2",
                         "run.checkpoint_every=1", f"run.output_dir={disk}", "run.name=full", "run.progress=false",
                         cwd=tmp_path)
        # The run had started (its progress lines come first): the error is the one last line, no traceback.
        assert out.returncode != 0 and "Traceback" not in out.stderr
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and out.stderr.strip().splitlines()[-1] == errors[0], out.stderr[-3000:]
        assert "disk full" in errors[0] and "free space" in errors[0] and f"--resume {disk / 'full'}" in errors[0]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
