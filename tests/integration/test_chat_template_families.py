"""A tiny model built for each shipped chat-template family (model.chat_template) trains: a short BC run moves
its loss, and a GRPO step rolls out, parses and scores in that family's format (docs/chat-templates.md)."""

from __future__ import annotations

import json

import pytest

from agentgrad.config import build_config
from agentgrad.data.store import TrajectoryStore
from agentgrad.pipelines.train import train

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
        "model.tiny.intermediate_size=128", "model.tiny.tokenizer_corpus_episodes=50"]
SHORT = ["env.options={min_operands: 2, max_operands: 2, min_digits: 2, max_digits: 2, operators: '+', "
         "result_digits: 2}", "rollout.max_total_tokens=512",  # the makers' tool preambles are long
         "bc.steps=30", "bc.batch_size_episodes=8", "bc.num_demos=64", "bc.lr=3e-3", "bc.stop_at_success=null",
         "algo.steps=1", "algo.tasks_per_step=2", "algo.group_size=2", "algo.epochs_per_step=1",
         "eval.num_tasks=8", "run.progress=false", "run.threads=1", "run.seed=0"]


@pytest.mark.slow
@pytest.mark.parametrize("family,thinking,prompt_marker", [
    ("qwen2.5", None, "<tool_call></tool_call> XML tags:"),
    ("qwen3", None, "<|im_end|>\n<|im_start|>assistant\n"),  # thinking on: the model writes the think block
    ("qwen3", False, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),  # off: every generation prompt closes one
    ("llama3", None, "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
])
def test_tiny_model_trains_with_each_family(tmp_path, family, thinking, prompt_marker):
    overrides = [*TINY, *SHORT, f"model.chat_template={family}", f"run.output_dir={tmp_path}", "run.name=run"]
    if thinking is not None:
        overrides.append(f"model.enable_thinking={str(thinking).lower()}")
    train(build_config(overrides=overrides))
    run_dir = tmp_path / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss/bc"] for r in rows if r["stage"] == "bc" and "loss/bc" in r]
    assert losses[-1] < 0.5 * losses[0], losses
    tokenizer_config = json.loads((run_dir / "base-model" / "tokenizer_config.json").read_text())
    template = tokenizer_config.get("chat_template") or (run_dir / "base-model" / "chat_template.jinja").read_text()
    from agentgrad.models.chat_templates import TEMPLATE_FAMILIES

    assert template == TEMPLATE_FAMILIES.get(family).template
    from transformers import AutoTokenizer

    from agentgrad.rollout.formats import TOOL_FORMATS

    tok = AutoTokenizer.from_pretrained(run_dir / "checkpoints" / "final")
    stored = [s.trajectory for s in TrajectoryStore(run_dir / "trajectories").trajectories()]
    parse = TOOL_FORMATS.get(TEMPLATE_FAMILIES.get(family).tool_format).parse
    assert stored
    for traj in stored:
        prompt = tok.decode(list(traj.token_ids[:traj.prompt_length]))
        assert prompt_marker in prompt[-300:], prompt[-300:]
        for turn in traj.turns:  # each sampled turn was parsed in the family's format
            if turn.end > turn.start and "token limit" not in getattr(turn.action, "error", ""):
                assert turn.action in parse(turn.text)
