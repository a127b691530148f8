"""Tests the claim "when task success is below 10%, GRPO converges 3 to 5 times faster than PPO".

One BC run on the tiny fast arithmetic shape is checked after every step on 200 validation tasks (the suite's
'test' split); the snapshot whose validation success is nearest each target (5%, 20%, 50%) becomes a start,
and its success on the 100 held-out tasks is measured and reported. From each start GRPO, PPO, RLOO and ReST
train on the same budget of generated tokens (the same tasks-per-step x samples-per-task batches, stopped once
the budget is spent), for several seeds. Reported per (start, algorithm): steps and tokens until the rolling
rollout success reaches a threshold, final held-out greedy success (the same 100 held-out tasks for every
run), and the fraction of zero-signal groups. Results are appended to a JSONL file as runs finish, so a
partial run still reports. Below the table: PPO's tokens to each threshold over GRPO's, seed by seed.

    nice -n 19 .venv/bin/python benchmarks/grpo_vs_ppo.py [--seeds 3] [--budget-tokens 150000] \\
        [--starts 0.05 ...] [--out DIR]
    nice -n 19 .venv/bin/python benchmarks/grpo_vs_ppo.py --algos grpo ppo --starts 0.05 --budget-tokens 600000 \\
        --set rollout.temperature=0.3 algo.lr=3e-4 --label T0.3-lr3e-4   # an arm with other settings
    nice -n 19 .venv/bin/python benchmarks/grpo_vs_ppo.py --table DIR/results.jsonl   # table only
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from agentgrad.checkpoint import save_checkpoint
from agentgrad.config import build_config
from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines.bc import bc_step, expert_demos
from agentgrad.pipelines.components import Components, build_components
from agentgrad.pipelines.evaluate import evaluate
from agentgrad.pipelines.run_state import run_alone
from agentgrad.pipelines.schedule import STAGES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from test_train_tiny import FAST  # the tiny fast shape the integration tests use

ALGOS = ("grpo", "ppo", "rloo", "rest")
TARGETS = (0.05, 0.20, 0.50)
VALIDATION_TASKS = 200
BC_STOP_VALIDATION = 0.8  # past the last target by a margin: the snapshots nearest each target are all seen
# Every algorithm sees 8 tasks x 8 samples per step and makes 2 passes (or 4 SFT steps for ReST) per batch.
SHARED = ["run.threads=1", "run.progress=false", "algo.tasks_per_step=8", "algo.group_size=8",
          "algo.epochs_per_step=2", "rest.tasks_per_iteration=8", "rest.samples_per_task=8", "rest.sft_steps=4",
          "rest.threshold_start=1.0",
          # the ReST measured in docs/algorithms.md's table: expert iteration as it was before ReST-EM
          "rest.improve_from=current", "rest.lr=3e-4", "rest.dedup=false"]


@dataclass(frozen=True)
class Start:
    target: float
    path: str
    bc_steps: int
    validation: float
    """Greedy success on VALIDATION_TASKS 'test'-split tasks: what chose this snapshot."""
    heldout: float
    """Greedy success on the 100 held-out tasks: the start every final is compared with."""


@dataclass(frozen=True)
class RunResult:
    start: float
    start_heldout: float
    algo: str
    seed: int
    steps: int
    tokens: float
    final_heldout: float
    zero_signal_fraction: float
    rollout_success: list[float]
    """Per step, sampled at the training temperature."""
    tokens_cumulative: list[float]
    wall_s: float
    label: str = ""
    """What `--set` changed (empty: the settings above), so arms with other settings share one results file."""


@dataclass
class _Candidate:
    distance: float
    step: int
    validation: float
    state: dict


def heldout(c: Components) -> float:
    # A fixed task seed (0) for every run, whatever its training seed, so finals are comparable.
    return evaluate(c.policy, c.codec, c.suite, c.limits, c.sampler, num_tasks=100, seed=0).success_rate


def validation(c: Components) -> float:
    return evaluate(c.policy, c.codec, c.suite, c.limits, c.sampler, num_tasks=VALIDATION_TASKS, seed=0,
                    split="test").success_rate


def bc_snapshots(out: Path) -> list[Start]:
    """One BC run, checked after every step; for each target the weights whose validation success is nearest."""
    config = build_config(overrides=[*FAST, *SHARED, "bc.stop_at_success=null", "bc.steps=400"])
    c = build_components(config, out / "bc")
    demos = expert_demos(c, config.bc.num_demos, seed=config.run.seed + 1)
    rng = random.Random(config.run.seed)
    best: dict[float, _Candidate] = {}
    for step in range(1, config.bc.steps + 1):
        bc_step(c, demos, rng, step - 1)
        val = validation(c)
        for target in TARGETS:
            if target not in best or abs(val - target) < best[target].distance:
                best[target] = _Candidate(abs(val - target), step, val, copy.deepcopy(c.loaded.model.state_dict()))
        if val >= BC_STOP_VALIDATION:
            break
    return [_save_start(c, target, cand, out) for target, cand in best.items()]


def _save_start(c: Components, target: float, cand: _Candidate, out: Path) -> Start:
    c.loaded.model.load_state_dict(cand.state)
    path = save_checkpoint(out / f"start-{target:.2f}", c.loaded.model, c.loaded.tokenizer)
    start = Start(target, str(path), cand.step, cand.validation, heldout(c))
    print(f"start {target:.0%}: BC step {start.bc_steps}, validation {start.validation:.1%}, "
          f"held-out {start.heldout:.0%}", flush=True)
    return start


def run_one(start: Start, algo: str, seed: int, budget_tokens: int, out: Path, extra: list[str],
            label: str) -> RunResult:
    config = build_config(overrides=[*FAST, *SHARED, "bc.steps=0", f"model.path={start.path}", f"algo={algo}",
                                     f"run.seed={seed}", "algo.steps=100000", "rest.iterations=100000", *extra])
    c = build_components(config, out / "runs" / f"{start.target:.2f}-{algo}-{seed}{'-' + label if label else ''}")
    tokens: list[float] = []
    success: list[float] = []
    zero_signal: list[float] = []

    def on_step(step: int, metrics) -> bool:
        tokens.append(metrics["rollout/generated_tokens"] + (tokens[-1] if tokens else 0.0))
        success.append(round(metrics["rollout/success_rate"], 3))
        zero_signal.append(metrics["rollout/zero_signal_groups"])
        return tokens[-1] >= budget_tokens

    t0 = time.perf_counter()
    run_alone(algo, STAGES.get(algo), c, RunLogger([], ProgressDisplay(enabled=False)), on_step=on_step)
    return RunResult(start.target, start.heldout, algo, seed, len(tokens), tokens[-1], heldout(c),
                     statistics.fmean(zero_signal), success, tokens, round(time.perf_counter() - t0, 1), label)


def steps_to(trace: list[float], threshold: float, window: int) -> int | None:
    """First step at which the mean rollout success of the last `window` steps reaches `threshold`."""
    for i in range(window - 1, len(trace)):
        if statistics.fmean(trace[i - window + 1:i + 1]) >= threshold:
            return i + 1
    return None


def _steps_cell(rs: list[RunResult], threshold: float, window: int) -> str:
    hits = [(h, r.tokens_cumulative[h - 1]) for r in rs if (h := steps_to(r.rollout_success, threshold, window))]
    if not hits:
        return f"- (0/{len(rs)})"
    steps = statistics.fmean(h for h, _ in hits)
    ktokens = statistics.fmean(t for _, t in hits) / 1000
    return f"{steps:.1f} / {ktokens:.0f}k ({len(hits)}/{len(rs)})"


def _mean_sd(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.0%}" + (f" ± {statistics.stdev(xs):.0%}" if len(xs) > 1 else "")


def table(rows: list[RunResult], thresholds: list[float], window: int) -> str:
    by = defaultdict(list)
    for r in rows:
        by[(r.start, r.label, r.algo)].append(r)
    reach = "".join(f" >= {t:.0%}: steps / tokens (runs) |" for t in thresholds)
    header = (f"| start: target (held-out) | algo | seeds |{reach} final held-out (mean ± sd) | "
              f"rollout success, first -> last {window} steps | zero-signal groups |")
    lines = [header, "|---" * (6 + len(thresholds)) + "|"]
    for (start, label, algo), rs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], ALGOS.index(kv[0][2]))):
        algo = f"{algo} ({label})" if label else algo
        first = statistics.fmean(statistics.fmean(r.rollout_success[:window]) for r in rs)
        last = [statistics.fmean(r.rollout_success[-window:]) for r in rs]
        zero = statistics.fmean(r.zero_signal_fraction for r in rs)
        reached = "".join(f" {_steps_cell(rs, t, window)} |" for t in thresholds)
        lines.append(f"| {start:.0%} ({rs[0].start_heldout:.0%}) | {algo} | {len(rs)} |{reached} "
                     f"{_mean_sd([r.final_heldout for r in rs])} | {first:.0%} -> {_mean_sd(last)} | {zero:.0%} |")
    return "\n".join(lines)


def ratios(rows: list[RunResult], thresholds: list[float], window: int) -> str:
    """PPO's tokens to each threshold over GRPO's, seed by seed (the claim's "3 to 5 times"), where both reached it."""
    tokens = {}
    for r in rows:
        for t in thresholds:
            if h := steps_to(r.rollout_success, t, window):
                tokens[(r.start, r.label, t, r.algo, r.seed)] = r.tokens_cumulative[h - 1]
    seeds = {r.seed for r in rows}
    lines = []
    for start, label in sorted({(r.start, r.label) for r in rows}):
        cells = []
        for t in thresholds:
            per_seed = sorted(tokens[(start, label, t, "ppo", s)] / tokens[(start, label, t, "grpo", s)]
                              for s in seeds
                              if (start, label, t, "ppo", s) in tokens and (start, label, t, "grpo", s) in tokens)
            if per_seed:
                cells.append(f">= {t:.0%}: {statistics.median(per_seed):.2f}x "
                             f"({per_seed[0]:.2f}-{per_seed[-1]:.2f}, {len(per_seed)} seeds)")
        if cells:
            lines.append(f"start {start:.0%}{' (' + label + ')' if label else ''}: PPO/GRPO tokens, median (range): "
                         + "; ".join(cells))
    return "\n".join(lines)


def read_results(path: Path) -> list[RunResult]:
    return [RunResult(**json.loads(line)) for line in path.read_text().splitlines()]


def load_or_make_starts(out: Path) -> list[Start]:
    """Starts are reused when `out` has them, so a cut-short sweep can be continued with the same snapshots."""
    path = out / "starts.json"
    if path.exists():
        return [Start(**s) for s in json.loads(path.read_text())]
    starts = bc_snapshots(out)
    path.write_text(json.dumps([dataclasses.asdict(s) for s in starts], indent=1))
    return starts


def sweep(args: argparse.Namespace) -> list[RunResult]:
    starts = load_or_make_starts(args.out)
    results = args.out / "results.jsonl"
    done = {(r.start, r.algo, r.seed, r.label) for r in read_results(results)} if results.exists() else set()
    rows = []
    for seed in range(args.seeds):  # seeds outermost: a cut-short run still has every cell once
        for start in [s for s in starts if s.target in args.starts]:
            for algo in args.algos:
                if (start.target, algo, seed, args.label) in done:
                    continue
                row = run_one(start, algo, seed, args.budget_tokens, args.out, args.set, args.label)
                rows.append(row)
                with results.open("a") as fh:
                    fh.write(json.dumps(dataclasses.asdict(row)) + "\n")
                print(f"{start.target:.0%} {algo} {args.label} seed {seed}: {row.steps} steps, "
                      f"held-out {start.heldout:.0%} -> {row.final_heldout:.0%}, "
                      f"zero-signal {row.zero_signal_fraction:.0%} ({row.wall_s} s)",
                      flush=True)
    return read_results(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--starts", type=float, nargs="+", default=list(TARGETS), choices=TARGETS,
                    help="Targets of the starts to train from (all by default).")
    ap.add_argument("--budget-tokens", type=int, default=150_000,
                    help="Generated tokens per run, resampling rounds included (1,800 to 7,000 per step here).")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.2, 0.5, 0.7],
                    help="Rolling rollout successes whose first crossing the table reports (steps and tokens).")
    ap.add_argument("--window", type=int, default=5, help="Steps in the rolling mean (and in the last-steps column).")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="Overrides for every run after the shared settings (e.g. algo.lr=1e-3); give --label too.")
    ap.add_argument("--label", default="", help="Names the --set arm in results.jsonl and the table.")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-grpo-vs-ppo"))
    ap.add_argument("--table", type=Path, help="Only print the table of an existing results.jsonl.")
    args = ap.parse_args()
    if args.set and not args.label:
        ap.error("--set needs --label (results of different settings share results.jsonl)")
    if args.table:
        rows = read_results(args.table)
        print(table(rows, args.thresholds, args.window))
        print(ratios(rows, args.thresholds, args.window))
        return
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = sweep(args)
    print(table(rows, args.thresholds, args.window))
    print(ratios(rows, args.thresholds, args.window))


if __name__ == "__main__":
    main()
