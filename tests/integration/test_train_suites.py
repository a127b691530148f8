"""`agentgrad train env=<suite>` runs end to end on every task suite (tiny model, a few steps of each stage).

This checks the wiring (suite defaults, tokenizer corpus, demonstrations that fit the limits, BC, GRPO with
real tools, held-out eval, summary), not learning: test_train_tiny.py checks that RL improves.
"""

from __future__ import annotations

import json

import pytest

from agentgrad.config import build_config, list_presets
from agentgrad.data.store import TrajectoryStore
from agentgrad.pipelines.train import train

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.tiny.intermediate_size=64", "model.tiny.tokenizer_corpus_episodes=50"]
BUDGET = ["bc.steps=2", "bc.batch_size_episodes=4", "bc.num_demos=8", "bc.stop_at_success=null",
          "algo.steps=1", "algo.tasks_per_step=2", "algo.group_size=2", "algo.epochs_per_step=1",
          "eval.num_tasks=2", "run.progress=false", "run.threads=1"]


CACHED = ("sql-qa", "multi-tool")  # suites that build databases: under the test's tmp dir, not the user's cache


@pytest.fixture(scope="module")
def jsonl_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("jsonl") / "tasks.jsonl"
    rows = [{"task_id": f"mul-{i}", "prompt": f"What is {12 + i} * {31 + i}?", "answer": str((12 + i) * (31 + i)),
             "tools": ["calculator"], "verifier": "numeric",
             "expert": [{"name": "calculator", "arguments": {"expression": f"{12 + i} * {31 + i}"}}]}
            for i in range(40)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("suite", ["search-qa", "sql-qa", "code", "multi-tool", "api-catalog", "jsonl"])
def test_train_runs_on_every_suite(suite, tmp_path, jsonl_path):
    options = f"{{cache_dir: {tmp_path}}}" if suite in CACHED else {"jsonl": f"{{path: {jsonl_path}}}"}.get(suite)
    config = build_config(overrides=[f"env={suite}", *([f"env.options={options}"] if options else []), *TINY, *BUDGET,
                                     f"run.output_dir={tmp_path}", "run.name=run"])
    summary = train(config)
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert summary["bc_steps"] == 2 and summary["rl_steps"] == 1
    stages = {json.loads(line)["stage"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    assert {"bc", "grpo", "eval_bc", "eval_final"} <= stages
    stored = list(TrajectoryStore(run_dir / "trajectories").trajectories())
    assert stored and all(s.trajectory.task.suite == stored[0].trajectory.task.suite for s in stored)


def test_bc_that_misses_its_target_says_so(tmp_path, capsys):
    """Two BC steps cannot reach 100% validation success: the run goes on, and the output says why it may fail."""
    budget = [o for o in BUDGET if not o.startswith("bc.stop_at_success")]
    train(build_config(overrides=[*TINY, *budget, "bc.stop_at_success=1.0", "bc.eval_every=1", "bc.eval_tasks=2",
                                  f"run.output_dir={tmp_path}", "run.name=run"]))
    assert "BC used all 2 steps without reaching validation success 100%" in capsys.readouterr().err


CPU_PRESETS = [name for name in list_presets() if not name.endswith("-gpu")]
# one Grow of 2 tasks x 2 samples and one Improve step: at its defaults (512 x 8 episodes) ReST's first Grow was
# most of the suite's longest preset case (code-cpu, ~50 s of sandboxed Python)
REST_BUDGET = ["rest.iterations=1", "rest.tasks_per_iteration=2", "rest.samples_per_task=2", "rest.sft_steps=1",
               "rest.batch_size_episodes=2"]


@pytest.mark.parametrize("preset", CPU_PRESETS)
def test_every_cpu_preset_runs_end_to_end(preset, tmp_path):
    """A shipped preset is a whole run (its suite, tokenizer, stages): shrunk to a few steps, it must finish."""
    cache = [f"env.options={{cache_dir: {tmp_path}}}"] if build_config(preset).env.name in CACHED else []
    config = build_config(preset, overrides=[*TINY, *BUDGET, *REST_BUDGET, *cache, f"run.output_dir={tmp_path}",
                                             "run.name=run"])
    summary = train(config)
    assert summary["bc_steps"] == 2 and summary["rl_steps"] >= 1  # ReST counts its own iterations
    stages = {json.loads(line)["stage"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()}
    assert {"bc", config.algo.name, "eval_bc", "eval_final"} <= stages
