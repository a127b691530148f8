"""Tests the claim "when task success is below 10%, GRPO converges 3 to 5 times faster than PPO".

One BC run on the tiny fast arithmetic shape is snapshotted when its greedy validation success first reaches
about 5%, 20% and 50%; from each snapshot GRPO, PPO, RLOO and ReST train on the same budget of generated tokens
(the same tasks-per-step x samples-per-task batches, stopped once the budget is spent), for several seeds.
Reported per (start, algorithm): steps and tokens until the rolling rollout success reaches a threshold,
final held-out greedy success (the same 100 held-out tasks for every run), and the fraction of zero-signal
groups. Results are appended to a JSONL file as runs finish, so a partial run still reports.

    nice -n 19 .venv/bin/python benchmarks/grpo_vs_ppo.py [--seeds 3] [--budget-tokens 20000] [--out DIR]
    nice -n 19 .venv/bin/python benchmarks/grpo_vs_ppo.py --table DIR/results.jsonl   # table only
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from agentgrad.checkpoint import save_checkpoint
from agentgrad.config import build_config
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines.bc import bc_step, expert_demos, validation_success
from agentgrad.pipelines.components import build_components
from agentgrad.pipelines.evaluate import evaluate
from agentgrad.pipelines.schedule import STAGES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from test_train_tiny import FAST  # noqa: E402  the tiny fast shape the integration tests use

ALGOS = ("grpo", "ppo", "rloo", "rest")
TARGETS = (0.05, 0.20, 0.50)
# Every algorithm sees 8 tasks x 8 samples per step and makes 2 passes (or 4 SFT steps for ReST) per batch.
SHARED = ["run.threads=1", "run.progress=false", "algo.tasks_per_step=8", "algo.group_size=8",
          "algo.epochs_per_step=2", "rest.tasks_per_iteration=8", "rest.samples_per_task=8", "rest.sft_steps=4",
          "rest.threshold_start=1.0"]


def heldout(c) -> float:
    # A fixed task seed (0) for every run, whatever its training seed, so finals are comparable.
    return evaluate(c.policy, c.codec, c.suite, c.limits, num_tasks=100, seed=0).success_rate


def bc_snapshots(out: Path) -> list[dict]:
    """One BC run, checked every 5 steps on validation tasks; a checkpoint when each target is first reached."""
    config = build_config(overrides=[*FAST, *SHARED, "bc.stop_at_success=null", "bc.steps=400"])
    c = build_components(config, out / "bc")
    demos = expert_demos(c, config.bc.num_demos, seed=config.run.seed + 1)
    rng = random.Random(config.run.seed)
    starts, pending = [], list(TARGETS)
    for step in range(config.bc.steps):
        bc_step(c, demos, rng, step)
        if (step + 1) % 5 or not pending:
            continue
        val = validation_success(c)
        while pending and val >= pending[0]:
            target = pending.pop(0)
            path = save_checkpoint(out / f"start-{target:.2f}", c.loaded.model, c.loaded.tokenizer)
            starts.append({"target": target, "path": str(path), "bc_steps": step + 1, "validation": val,
                           "heldout": heldout(c)})
            print(f"start {target:.0%}: BC step {step + 1}, validation {val:.0%}, held-out {starts[-1]['heldout']:.0%}",
                  flush=True)
        if not pending:
            break
    return starts


def run_one(start: dict, algo: str, seed: int, budget_tokens: int, threshold: float, window: int, out: Path) -> dict:
    config = build_config(overrides=[*FAST, *SHARED, "bc.steps=0", f"model.path={start['path']}", f"algo={algo}",
                                     f"run.seed={seed}", "algo.steps=1000", "rest.iterations=1000"])
    c = build_components(config, out / "runs" / f"{start['target']:.2f}-{algo}-{seed}")
    trace: list[dict] = []

    def on_step(step: int, metrics) -> bool:
        tokens = metrics["rollout/generated_tokens"] + (trace[-1]["tokens"] if trace else 0.0)
        trace.append({"tokens": tokens, "success": metrics["rollout/success_rate"],
                      "zero_signal": metrics["rollout/zero_signal_groups"]})
        return tokens >= budget_tokens

    t0 = time.perf_counter()
    STAGES.get(algo)(c, RunLogger([], ProgressDisplay(enabled=False)), None, on_step, 0)
    reached = steps_to([t["success"] for t in trace], threshold, window)
    return {"start": start["target"], "start_heldout": start["heldout"], "algo": algo, "seed": seed,
            "steps": len(trace), "tokens": trace[-1]["tokens"], "steps_to_threshold": reached,
            "tokens_to_threshold": trace[reached - 1]["tokens"] if reached else None,
            "final_heldout": heldout(c), "zero_signal_fraction": statistics.fmean(t["zero_signal"] for t in trace),
            "rollout_success": [round(t["success"], 3) for t in trace], "tokens_cumulative": [t["tokens"] for t in trace],
            "wall_s": round(time.perf_counter() - t0, 1)}


def steps_to(trace: list[float], threshold: float, window: int) -> int | None:
    """First step at which the mean rollout success of the last `window` steps reaches `threshold`."""
    for i in range(window - 1, len(trace)):
        if statistics.fmean(trace[i - window + 1:i + 1]) >= threshold:
            return i + 1
    return None


def table(rows: list[dict], threshold: float, window: int) -> str:
    by = defaultdict(list)
    for r in rows:
        by[(r["start"], r["algo"])].append(r)
    lines = [f"| start: target (held-out) | algo | seeds | steps to rolling rollout success >= {threshold:.0%} | "
             "final held-out (mean ± sd) | zero-signal groups |", "|---|---|---|---|---|---|"]
    for (start, algo), rs in sorted(by.items(), key=lambda kv: (kv[0][0], ALGOS.index(kv[0][1]))):
        hits = [h for r in rs if (h := steps_to(r["rollout_success"], threshold, window))]
        steps = f"{statistics.fmean(hits):.1f} ({len(hits)}/{len(rs)} reached)" if hits else f"not reached (0/{len(rs)})"
        finals = [r["final_heldout"] for r in rs]
        spread = f" ± {statistics.stdev(finals):.0%}" if len(finals) > 1 else ""
        zero = statistics.fmean(r["zero_signal_fraction"] for r in rs)
        lines.append(f"| {start:.0%} ({rs[0]['start_heldout']:.0%}) | {algo} | {len(rs)} | {steps} | "
                     f"{statistics.fmean(finals):.0%}{spread} | {zero:.0%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--budget-tokens", type=int, default=20_000, help="Generated tokens per run (~10 steps of 64 episodes).")
    ap.add_argument("--threshold", type=float, default=0.3, help="Rolling rollout success that counts as converged.")
    ap.add_argument("--window", type=int, default=2, help="Steps in the rolling mean.")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-grpo-vs-ppo"))
    ap.add_argument("--table", type=Path, help="Only print the table of an existing results.jsonl.")
    args = ap.parse_args()
    if args.table:
        print(table([json.loads(line) for line in args.table.read_text().splitlines()], args.threshold, args.window))
        return
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    starts = bc_snapshots(args.out)
    (args.out / "starts.json").write_text(json.dumps(starts, indent=1))
    results = args.out / "results.jsonl"
    rows = []
    for seed in range(args.seeds):  # seeds outermost: a cut-short run still has every cell once
        for start in starts:
            for algo in args.algos:
                row = run_one(start, algo, seed, args.budget_tokens, args.threshold, args.window, args.out)
                rows.append(row)
                with results.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
                print(f"{start['target']:.0%} {algo} seed {seed}: steps to threshold {row['steps_to_threshold']}, "
                      f"held-out {start['heldout']:.0%} -> {row['final_heldout']:.0%}, zero-signal "
                      f"{row['zero_signal_fraction']:.0%} ({row['wall_s']} s)", flush=True)
    print(table(rows, args.threshold, args.window))


if __name__ == "__main__":
    main()
