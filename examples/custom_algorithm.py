"""A new RL algorithm in one function: an advantage estimator with the one signature all of them share.

    estimator(token_rewards, loss_mask, group_index, values, params) -> AdvantageOutput   # (B, T) tensors

`median_baseline` centres each episode's return on the *median* of its group instead of the mean (GRPO) or the
leave-one-out mean (RLOO): with pass/fail rewards and fewer than half of a group passing, the median is 0, so
only the successes are pushed up (like rejection-sampling fine-tuning); with more than half passing, it is 1,
and only the failures are pushed down. Everything else (rollouts, KL, clipping, the learner) is the online
step every algorithm shares (pipelines/rl.py). docs/adding-an-algorithm.md walks through it.

Run it (trains the tiny model a few steps with it, about a minute on a CPU; prints what the estimator did):

    python examples/custom_algorithm.py [--bc-steps 30] [--rl-steps 3] [--out runs]

or, without registering anything, name it by import path from the repository root:

    agentgrad train algo.advantage_estimator=examples.custom_algorithm:median_baseline
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from torch import Tensor

from agentgrad.algos.advantages import AdvantageOutput, AdvantageParams, turn_returns

CALLS = {"batches": 0, "rows": 0, "rows_with_signal": 0}  # what main() reports: the estimator really ran


@torch.no_grad()
def median_baseline(token_rewards: Tensor, loss_mask: Tensor, group_index: Tensor, values: Tensor | None,
                    params: AdvantageParams) -> AdvantageOutput:
    """A_{i,k} = G_{i,k} - median of the group's episode scores G_0 (torch's median: the lower middle value
    of an even count). Rows without policy tokens, and groups of one valid row, get 0; `values` is ignored."""
    returns, scores = turn_returns(token_rewards, loss_mask, params.gamma)  # (B, T), (B,)
    valid = (loss_mask > 0).any(dim=1)  # (B,)
    baseline = scores.clone()  # (B,): a row with no group to compare with is its own baseline (advantage 0)
    for group in group_index.unique():
        rows = valid & (group_index == group)  # (B,)
        if int(rows.sum()) >= 2:
            baseline[rows] = scores[rows].median()
    advantages = torch.where(loss_mask > 0, returns - baseline.unsqueeze(1), torch.zeros_like(returns))  # (B, T)
    CALLS["batches"] += 1
    CALLS["rows"] += int(valid.sum())
    CALLS["rows_with_signal"] += int((advantages != 0).any(dim=1).sum())
    return AdvantageOutput(advantages=advantages, returns=returns)


def digits_right(answer: str | None, expected: str) -> float:
    """Partial credit, for a model too undertrained to be right yet: the share of the expected answer's
    characters that the answer has in the same place ("3402" for "3412": 0.75). A verifier (rewards/verifiers.py)
    that returns a float instead of a bool."""
    got = (answer or "").strip()
    return sum(a == b for a, b in zip(got, expected)) / max(len(expected), len(got), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description="Train the tiny model a few steps with the median-baseline estimator.")
    ap.add_argument("--bc-steps", type=int, default=30, help="BC warm-up steps (the default run stops near 90)")
    ap.add_argument("--rl-steps", type=int, default=3, help="RL steps with the new estimator")
    ap.add_argument("--out", default=None, help="runs directory (default: a temporary one)")
    ns = ap.parse_args()

    from agentgrad.algos.advantages import ADVANTAGE_ESTIMATORS
    from agentgrad.config import build_config
    from agentgrad.pipelines.train import train
    from agentgrad.rewards.verifiers import VERIFIERS

    ADVANTAGE_ESTIMATORS.add("median_baseline", median_baseline)  # one registry, one signature
    VERIFIERS.add("digits_right", digits_right)
    config = build_config("tiny-cpu", [
        "algo.advantage_estimator=median_baseline",
        f"bc.steps={ns.bc_steps}", "bc.stop_at_success=null",  # a short warm-up: BC's stop rule needs ~90 steps
        f"algo.steps={ns.rl_steps}", "algo.tasks_per_step=4", "algo.group_size=4", "algo.epochs_per_step=1",
        # pass/fail gives a 30-step BC policy nothing to learn from (every group fails alike): partial credit
        "reward.name=verifier", "reward.options.verifier=digits_right",
        "eval.num_tasks=20", "run.name=median-baseline", f"run.output_dir={ns.out or tempfile.mkdtemp()}",
    ])
    summary = train(config)
    print(json.dumps({"estimator": "median_baseline", **CALLS, "rl_steps": summary["rl_steps"],
                      "initial_success_rate": summary["initial_success_rate"],
                      "final_success_rate": summary["final_success_rate"], "run_dir": summary["run_dir"]}))


if __name__ == "__main__":
    main()
