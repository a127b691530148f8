"""Every script in examples/ runs as a user runs it, `python examples/X.py` in a real process, and its output
shows that it did its job (not just exit 0). A new example without a case here fails `test_every_example_is_run`.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
    [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}

COVERED = {"custom_tool.py", "custom_reward.py", "guess_number.py", "mcp_calculator.py", "custom_algorithm.py",
           "convert_tasks.jsonl"}  # the data file is run through `agentgrad check`, as its docs say


def run(*args: str, timeout: float = 300) -> str:
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def test_every_example_is_run():
    present = {p.name for p in EXAMPLES.iterdir() if p.is_file() and p.name != "__init__.py"}
    assert present == COVERED, f"add a test for {sorted(present - COVERED)} (or drop {sorted(COVERED - present)})"


def test_custom_tool():
    lines = run("examples/custom_tool.py").splitlines()
    schema = json.loads(lines[0].removeprefix("schema: "))
    assert schema["function"]["name"] == "convert"
    assert schema["function"]["parameters"]["required"] == ["amount", "source", "target"]
    assert schema["function"]["parameters"]["properties"]["amount"]["type"] == "number"
    # 10 EUR at 1.08 USD per EUR (the example's rate table) = 10.80 USD
    assert lines[1].endswith("-> ok=True error_kind=None text='10.80 USD'")
    assert "ok=False error_kind=crashed" in lines[2] and "unknown currency" in lines[2]
    assert "ok=False error_kind=bad_arguments" in lines[3]


def test_custom_reward():
    out = run("examples/custom_reward.py")
    # short_and_right: 1.0 for a verified answer, minus 0.05 per turn beyond two
    assert "expert (call, answer): 2 turns, reward 1.00" in out
    assert "extra call (call, call, answer): 3 turns, reward 0.95" in out
    assert "wrong answer (call, answer + 1): 2 turns, reward 0.00" in out


def test_guess_number():
    report = ast.literal_eval(run("examples/guess_number.py").strip())  # check_suite's report, printed
    assert report["success_from"] == "env"  # the game, not a verifier, says who won
    assert report["expert_tasks"] == 20  # check_suite's default: the expert won all 20 games it played
    assert all(n > 0 for n in report["distinct_tasks"].values())


def test_convert_tasks_jsonl_passes_agentgrad_check():
    out = run("-m", "agentgrad.cli", "check", "env=jsonl", "env.options.path=examples/convert_tasks.jsonl",
              "--tasks", "5")
    report = json.loads(out.splitlines()[-1])
    assert report["suite"] == "jsonl" and report["expert_masked"] == 0
    assert report["expert_mean_reward"] == 1.0  # the expert's convert call and answer verify on every task


def test_mcp_calculator_serves_its_tool_over_stdio(tmp_path):
    pytest.importorskip("mcp", reason="needs the mcp extra: pip install -e '.[mcp]' (.ci/run installs it)")
    from agentgrad.tools.mcp import McpConnection

    log = tmp_path / "calls.jsonl"
    conn = McpConnection("calc", command=sys.executable, args=[str(EXAMPLES / "mcp_calculator.py"), "--log",
                                                                 str(log)],
                         env={"PYTHONPATH": ENV["PYTHONPATH"]}, connect_timeout_s=180.0, timeout_s=120.0)
    try:
        [calculator] = conn.tools()
        assert calculator.name == "calculator" and "expression" in calculator.parameters["properties"]
        result = calculator(expression="12 * (3 + 4)")
        assert (result.ok, result.text) == (True, "84")
        bad = calculator(expression="12 *")
        assert not bad.ok
    finally:
        conn.close()
    assert log.read_text().splitlines() == ['"12 * (3 + 4)"', '"12 *"']  # both calls reached the server process


@pytest.mark.slow
def test_custom_algorithm_trains_the_tiny_model_with_its_estimator(tmp_path):
    out = run("examples/custom_algorithm.py", "--out", str(tmp_path), timeout=600)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["estimator"] == "median_baseline" and summary["rl_steps"] == 3
    # the estimator ran once per RL step, on all 4 tasks x 4 samples of each, and gave some rows a signal
    assert summary["batches"] == 3 and summary["rows"] == 48 and summary["rows_with_signal"] > 0
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").open()]
    rl = [r for r in records if r.get("stage") == "grpo"]
    assert len(rl) == 3 and sum(r["train/updates"] for r in rl) > 0  # the policy was updated with its advantages
    assert (Path(summary["run_dir"]) / "checkpoints" / "final").is_dir()
