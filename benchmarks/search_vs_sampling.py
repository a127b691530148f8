"""Tree search vs best-of-N sampling from the same BC'd policy, at counted budgets (docs/search.md).

1. A BC'd policy: `--checkpoint DIR`, or BC is run first (`--bc-out DIR`, the run's own stop rule).
2. The value model (config critic.model) is fitted on Monte-Carlo returns of policy rollouts on train tasks
   (`--value-tasks` x 4 samples); this is amortised across tasks and not counted in any per-task budget.
3. On `--tasks` held-out tasks: search at each `--top-k` (0 = keep all), and best-of-N for N in `--n`; each row
   prints success (the search or any of the N samples reached a verified success) and the mean per-task cost in
   generated tokens and tool calls (the search's replays that restore nodes included); then best-of-k at each
   search's budget (the smallest k costing at least as much in both, pass@k over the last best-of-N's samples).
   `--split test` compares on the validation split instead, to choose settings without the held-out tasks.

    python benchmarks/search_vs_sampling.py --bc-out /tmp/bc --suite arithmetic-products
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from agentgrad.config import build_config
from agentgrad.models.value import build_critic
from agentgrad.pipelines.components import build_components
from agentgrad.pipelines.mcts import examples_of, run_search
from agentgrad.pipelines.rl import rl_tasks, rollout_groups
from agentgrad.pipelines.train import train
from agentgrad.search.tree import expanded_per_depth, iter_nodes
from agentgrad.search.value import CriticValues, calibration_metrics, fit_values
from agentgrad.types import ToolCall

SUITES = {
    # test_train_tiny.FAST's products: a 4-digit product must be copied from the calculator (2 turns).
    "arithmetic-products": [
        "env.options={min_operands: 2, max_operands: 2, min_digits: 2, max_digits: 2, operators: '*', "
        "result_digits: 4}", "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=4",
        "model.tiny.num_kv_heads=2", "model.tiny.intermediate_size=192", "model.tiny.tokenizer_corpus_episodes=100",
        "bc.steps=400", "bc.eval_tasks=48", "bc.num_demos=500", "bc.lr=3e-3", "bc.lr_scale_near_target=1.0",
        "bc.stop_at_success=0.3"],
    # 1-3 calls among 228 APIs (login, a lookup, a weather lookup), then the answer.
    # BC as docs/action-space.md trains it (its model: 64 wide, 2 layers; 1,500 steps of 16 episodes, lr 3e-3,
    # 1,000 demos), all 1,500 steps: no stop rule, whose validation every step after the first success cost
    # more than the steps (~1 s a check of 48 tasks against ~0.15 s a step).
    "api-catalog": ["env=api-catalog", "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=4",
                    "model.tiny.num_kv_heads=2", "model.tiny.intermediate_size=192",
                    "model.tiny.tokenizer_corpus_episodes=200", "bc.steps=1500", "bc.batch_size_episodes=16",
                    "bc.lr=3e-3", "bc.num_demos=1000", "bc.stop_at_success=null"],
}


def wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return 0.0, 0.0
    z, p = 1.96, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def row(name: str, wins: int, n: int, tokens: float, calls: float, seconds: float) -> None:
    lo, hi = wilson(wins, n)
    print(f"| {name} | {wins}/{n} = {wins / n:.0%} [{lo:.0%}, {hi:.0%}] | {tokens:.0f} | {calls:.1f} | "
          f"{seconds:.0f} s |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--suite", choices=sorted(SUITES), default="arithmetic-products")
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--bc-out", type=Path)
    p.add_argument("--tasks", type=int, default=48)
    p.add_argument("--value-tasks", type=int, default=32)
    p.add_argument("--top-k", type=int, nargs="+", default=[5, 0])
    p.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="heldout", help="tasks to compare on ('test': the validation split, for "
                   "choosing settings without looking at the held-out tasks)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="a config override (repeatable)")
    p.add_argument("--diffs-out", type=Path, help="append each paired comparison's per-task differences here "
                   "(JSONL), to pool seeds")
    p.add_argument("--variant", action="append", default=[], help="mcts settings of one more search row, as "
                   "space-separated key=value (e.g. 'coverage=0.9 expansion_batch=2'); repeatable")
    p.add_argument("--pool", type=Path, help="only print the pooled comparisons of a --diffs-out file")
    args = p.parse_args()
    if args.pool:
        return pool(args.pool)
    base = [*SUITES[args.suite], f"run.seed={args.seed}", "run.progress=false", *args.overrides]
    checkpoint = args.checkpoint
    if checkpoint is None:
        if args.bc_out is None:
            sys.exit("error: give --checkpoint DIR or --bc-out DIR")
        summary = train(build_config(overrides=[*base, "algo=bc", f"run.output_dir={args.bc_out}", "run.name=bc"]))
        print(f"BC: held-out {summary['final_success_rate']:.1%}", flush=True)
        checkpoint = args.bc_out / "bc" / "checkpoints" / "bc"
    config = build_config(overrides=[*base, "bc.steps=0", f"model.path={checkpoint}"])
    c = build_components(config, Path("/tmp") / f"search-bench-{args.seed}")
    critic = build_critic(c.loaded.model, config.critic.model, lr=config.critic.lr)
    groups = rollout_groups(c, rl_tasks(c, 0, n=args.value_tasks), 0, group_size=4)
    examples = examples_of([(s.trajectory, s.success) for g in groups for s in g.samples])
    fitted = fit_values(critic, examples, c.pad_token_id, steps=config.mcts.value_fit_steps * 2,
                        batch_size=config.mcts.value_batch_size, seed=args.seed)
    ece = calibration_metrics(CriticValues(critic, c.pad_token_id).predict(examples)).get("value/ece", float("nan"))
    print(f"value model: {len(examples)} episodes, loss {fitted['value/loss_first']:.3f} -> "
          f"{fitted['value/loss_last']:.3f}, in-sample ECE {ece:.3f}", flush=True)
    tasks = c.suite.sample_tasks(args.tasks, split=args.split, seed=args.seed)
    print(f"\n{args.suite}, {len(tasks)} {args.split} tasks, seed {args.seed}, mcts: "
          f"{config.mcts.simulations} simulations, {config.mcts.samples_per_expansion} samples per expansion\n")
    print("| method | success [95% CI] | tokens / task | tool calls / task | wall |\n|---|---|---|---|---|")
    budgets: list[tuple[str, float, float, list[bool]]] = []  # each search: name, mean cost per task, successes
    variants = [dict(kv.split("=", 1) for kv in v.split()) for v in args.variant] or [{}]
    for variant, k in [(v, k) for v in variants for k in args.top_k]:
        mcts = config.mcts.model_validate({**config.mcts.model_dump(), **variant, "top_k": k})
        c.config = config.model_copy(update={"mcts": mcts})
        t0 = time.perf_counter()
        results = run_search(c, critic, tasks, 10_000)
        widest = max(len(n.children) for r in results for n in iter_nodes(r.root))
        expanded = [n for r in results for n in iter_nodes(r.root) if n.expanded]
        # distinct candidates an expansion or widening saw before pruning (each widening used is one more event)
        events = sum(1 + mcts.widenings - n.widenings_left for n in expanded)
        seen = sum(n.candidates for n in expanded) / max(1, events)
        depths = [expanded_per_depth(r.root) for r in results]
        per_depth = " / ".join(f"{sum(d.get(i, 0) for d in depths) / len(depths):.2f}"
                               for i in range(max((max(d, default=0) for d in depths), default=0) + 1))
        label = f"K={k or 'all'}" + "".join(f" {key}={value}" for key, value in variant.items())
        name = (f"search {label}, {mcts.widenings} widenings (widest {widest}; expanded per tree at "
                f"depth 0 / 1 / ...: {per_depth}; {seen:.2f} distinct candidates per expansion)")
        tokens, calls = (sum(r.generated_tokens for r in results) / len(results),
                         sum(r.tool_calls for r in results) / len(results))
        row(name, sum(r.success for r in results), len(results), tokens, calls, time.perf_counter() - t0)
        budgets.append((label, tokens, calls, [r.success for r in results]))
    c.config = config
    for n in args.n:
        t0 = time.perf_counter()
        groups = rollout_groups(c, tasks, 20_000, group_size=n)
        samples = [s for g in groups for s in g.samples]
        calls = sum(isinstance(t.action, ToolCall) for s in samples for t in s.trajectory.turns)
        row(f"best-of-{n}", sum(any(s.success for s in g.samples) for g in groups), len(groups),
            sum(s.trajectory.num_generated_tokens for s in samples) / len(groups), calls / len(groups),
            time.perf_counter() - t0)
    matched_budget(groups, budgets, args.diffs_out)


def pass_at(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a task with c successes among n samples (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def pool(path: Path) -> None:
    """Pooled paired differences over every run appended to `path` (seeds), by comparison."""
    by_key: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_key.setdefault(record["key"], []).extend(record["diffs"])
    for key, diffs in by_key.items():
        mean = sum(diffs) / len(diffs)
        half = 1.96 * math.sqrt(sum((d - mean) ** 2 for d in diffs) / max(1, len(diffs) - 1) / len(diffs))
        print(f"pooled, search {key}: {mean * 100:+.2f} points [{(mean - half) * 100:+.2f}, "
              f"{(mean + half) * 100:+.2f}] over {len(diffs)} tasks")


def paired(label: str, successes: list[bool], expected: list[float], out: Path | None, key: str) -> None:
    """The search's 0/1 minus the sampler's expected success, task by task on the same tasks: the mean with a
    normal 95% interval over tasks, and the tasks where one side is ahead (the search solved it while the
    sampler's chance is below 1/2, or failed it while above). Per-task differences go to `out` (JSONL) for
    pooling seeds."""
    diffs = [float(won) - p for won, p in zip(successes, expected, strict=True)]
    mean = sum(diffs) / len(diffs)
    half = 1.96 * math.sqrt(sum((d - mean) ** 2 for d in diffs) / max(1, len(diffs) - 1) / len(diffs))
    ahead = sum(won and p < 0.5 for won, p in zip(successes, expected))
    behind = sum(not won and p > 0.5 for won, p in zip(successes, expected))
    print(f"paired, {label}: {mean * 100:+.1f} points [{(mean - half) * 100:+.1f}, {(mean + half) * 100:+.1f}] "
          f"over {len(diffs)} tasks; search ahead on {ahead}, behind on {behind}", flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(json.dumps({"key": key, "label": label, "diffs": diffs}) + "\n")


def matched_budget(groups: list, budgets: list[tuple[str, float, float, list[bool]]], out: Path | None) -> None:
    """Best-of-k at each search's budget, two ways, each with the paired difference on the same tasks:
    - the smallest integer k whose mean cost is at least the search's in both generated tokens and tool calls
      (sampling gets up to one sample more than the search spent);
    - exactly the search's mean cost in the binding resource: k* = the larger cost ratio, realised as a mixture
      of best-of-floor(k*) and best-of-(floor(k*) + 1) with weight k* - floor(k*) on the larger, so its expected
      cost equals the search's and its success is the same mixture of the two pass@k.
    Success is the unbiased pass@k over the last best-of-n's samples."""
    n = len(groups[0].samples)
    samples = [s for g in groups for s in g.samples]
    tokens = sum(s.trajectory.num_generated_tokens for s in samples) / len(samples)  # per sample
    calls = sum(isinstance(t.action, ToolCall) for s in samples for t in s.trajectory.turns) / len(samples)
    wins = [sum(s.success for s in g.samples) for g in groups]
    for name, search_tokens, search_calls, successes in budgets:
        k_exact = max(search_tokens / tokens, search_calls / max(calls, 1e-9))
        k = math.ceil(k_exact)
        if k > n:
            print(f"| best-of-k at search {name}'s budget | needs k = {k} > {n} samples | | | |")
            continue
        at_k = [pass_at(n, c, k) for c in wins]
        print(f"| best-of-{k} at search {name}'s budget (pass@{k} of the {n} samples) | {sum(at_k):.1f}/{len(groups)} "
              f"= {sum(at_k) / len(groups):.1%} | {k * tokens:.0f} | {k * calls:.1f} | |", flush=True)
        paired(f"search {name} minus pass@{k}", successes, at_k, out, f"{name} vs the smallest k")
        k_lo = max(1, math.floor(k_exact))
        f = min(1.0, max(0.0, k_exact - k_lo))
        mixture = [(1 - f) * pass_at(n, c, k_lo) + f * pass_at(n, c, min(n, k_lo + 1)) for c in wins]
        print(f"| best-of-{k_exact:.2f} (best-of-{k_lo} and -{k_lo + 1} mixed) at exactly search {name}'s budget | "
              f"{sum(mixture):.1f}/{len(groups)} = {sum(mixture) / len(groups):.1%} | {k_exact * tokens:.0f} | "
              f"{k_exact * calls:.1f} | |", flush=True)
        paired(f"search {name} minus best-of-{k_exact:.2f}", successes, mixture, out, f"{name} vs the exact budget")

if __name__ == "__main__":
    main()
