"""`agentgrad train model.path=DIR` on a local HF model with a Qwen2.5-style template, and `agentgrad eval`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def qwen_style_model(tmp_path_factory, arithmetic_suite):
    from agentgrad.config import build_config
    from agentgrad.models.chat_templates import QWEN25_STYLE_TEMPLATE
    from agentgrad.models.tiny import build_tiny_model, train_tokenizer
    from agentgrad.pipelines.components import _render_expert_transcripts

    corpus = _render_expert_transcripts(arithmetic_suite, 50, seed=0)
    tokenizer = train_tokenizer(corpus, vocab_size=400)
    tokenizer.chat_template = QWEN25_STYLE_TEMPLATE
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    directory = tmp_path_factory.mktemp("qwen-style")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del build_config
    return directory


def _agentgrad(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentgrad.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_train_and_eval_a_local_model_with_its_own_template(qwen_style_model, tmp_path):
    out = _agentgrad("train", f"model.path={qwen_style_model}", "bc.steps=3", "bc.num_demos=8", "algo.steps=2",
                     "algo.tasks_per_step=2", "algo.group_size=2", "eval.num_tasks=4", "run.name=qwen",
                     "run.progress=false", "rollout.max_total_tokens=1024", f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "qwen"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"initial_success_rate", "final_success_rate"} <= set(summary)
    # The rollouts were rendered with the model's own template (Qwen's "# Tools" section), token-in/token-out.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run_dir / "checkpoints" / "final")
    from agentgrad.data.store import TrajectoryStore

    first = next(TrajectoryStore(run_dir / "trajectories").trajectories())
    text = tok.decode(first.trajectory.token_ids)
    assert "# Tools" in text and '"name": "calculator"' in text
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "config.yaml").exists()

    ev = _agentgrad("eval", str(run_dir), "--json", "--num-tasks", "4", cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert 0.0 <= result["success_rate"] <= 1.0 and result["num_tasks"] == 4


def test_bad_override_is_a_clear_error(tmp_path):
    out = _agentgrad("train", "algo.grup_size=4", cwd=tmp_path)
    assert out.returncode == 2 and "valid keys here" in out.stderr and "group_size" in out.stderr


def test_missing_model_path_is_a_clear_error(tmp_path):
    out = _agentgrad("train", f"model.path={tmp_path / 'nope'}", "run.progress=false",
                     f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 2 and "could not load" in out.stderr
