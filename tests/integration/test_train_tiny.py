"""The whole loop on a small budget: build the tiny model, BC warm-up, GRPO; RL must move the numbers."""

import json

import pytest
import torch
from learning import SWEEP, assert_lift

from agentgrad.config import build_config
from agentgrad.pipelines.train import train

# An easier arithmetic shape than the default run ("12 + 34 = ?"): same tools, template, loop, stop rule and
# algorithms, sized so that BC reaches a partial policy within a minute and RL has something left to fix.
FAST = [
    # Products, not sums: this model learns 2-digit addition well enough to guess ~45% of sums without the tool
    # (seed 1 handed RL such a policy, which GRPO lifted 4 points in 15 steps); a 4-digit product can only be
    # copied from the calculator, so BC's partial policy is a partial copier, which RL completes on every seed.
    "env.options={min_operands: 2, max_operands: 2, min_digits: 2, max_digits: 2, operators: '*', result_digits: 4}",
    "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
    "model.tiny.intermediate_size=192", "model.tiny.tokenizer_corpus_episodes=100",
    # BC lr 3e-3 (the default run's is 1e-3, a quarter near the target): on sums the lower lr took 163 steps to a
    # policy that estimated answers; on products BC stops at steps ~90-110 (bc_probe.py: copy learned by ~100).
    "bc.steps=400", "bc.eval_tasks=48", "bc.num_demos=500", "bc.lr=3e-3", "bc.lr_scale_near_target=1.0",
    "bc.stop_at_success=0.3",
    "algo.steps=25", "algo.tasks_per_step=8", "algo.group_size=8",
    "eval.num_tasks=200", "run.progress=false", "run.name=fast", *SWEEP,
]


@pytest.mark.slow
@pytest.mark.learning
def test_bc_then_grpo_changes_parameters_and_improves(tmp_path):
    config = build_config(overrides=[*FAST, f"run.output_dir={tmp_path}"])
    summary = train(config)
    run_dir = tmp_path / "fast"
    from safetensors.torch import load_file

    before = load_file(run_dir / "checkpoints" / "bc" / "model.safetensors")
    after = load_file(run_dir / "checkpoints" / "final" / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), f"RL left {len(before) - len(changed)} tensors untouched"

    # BC hands RL a partial policy (its stop rule's job), and RL lifts it by far more than the noise.
    assert 0.1 <= summary["initial_success_rate"] <= 0.7, summary["initial_eval"]
    assert_lift("bc+grpo", summary["initial_eval"], summary["final_eval"], min_points=0.25)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r["rollout/success_rate"] for r in rows if r["stage"] == "grpo"]
    assert sum(rl[-5:]) > sum(rl[:5]), rl  # sampled (T 0.7) success rises too, from a low start in this shape
