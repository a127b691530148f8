"""How long are the expert demonstrations, and do the shipped rollout limits fit them on every seed?

For each suite and seed this builds what `agentgrad train env=<suite> run.seed=<seed>` builds before BC (the
suite, the tiny tokenizer trained on that seed's corpus, the chat codec), encodes `bc.num_demos` expert
demonstrations of the tasks BC would clone (seed + 1) with no limits, and prints, per suite: total tokens (median,
99th percentile, max) against rollout.max_total_tokens, turns against rollout.max_turns, the longest turn against
rollout.max_new_tokens_per_turn, and how many demonstrations the shipped limits would drop.

    python benchmarks/demo_lengths.py                                  # every suite, seeds 0-19 (~40 min)
    python benchmarks/demo_lengths.py --suites multi-tool --seeds 0-4 --raw /tmp/lengths.jsonl
    python benchmarks/demo_lengths.py --from-raw /tmp/lengths.jsonl    # re-check saved lengths against the limits

No training; nothing is downloaded. The table in docs/demo-limits.md comes from the first command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from agentgrad.config import build_config
from agentgrad.envs import SUITES
from agentgrad.models.hf import load_model
from agentgrad.pipelines.components import build_tiny_model_dir, episode_limits, make_suite, quiet_hf
from agentgrad.pipelines.demos import DemoLength, unlimited
from agentgrad.rollout.chat import ChatCodec
from agentgrad.rollout.loop import expert_trajectory

SUITE_NAMES = ("arithmetic", "search-qa", "sql-qa", "code", "multi-tool", "api-catalog")


def seed_list(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def measure(suite_name: str, seed: int, num_demos: int | None, workdir: Path) -> list[DemoLength]:
    config = build_config(overrides=[f"env={suite_name}", f"run.seed={seed}"])
    suite = make_suite(config)
    try:
        loaded = load_model(build_tiny_model_dir(config, suite, workdir / f"{suite_name}-{seed}"))
        codec = ChatCodec(loaded.tokenizer, loaded.eos_token_ids)
        env, limits = suite.make_env(), unlimited(episode_limits(config))
        tasks = suite.sample_tasks(num_demos or config.bc.num_demos, split="train", seed=seed + 1)  # as run_bc
        return [DemoLength.of(expert_trajectory(env, t, suite.expert_actions(t), codec, limits)) for t in tasks]
    finally:
        getattr(suite, "close", lambda: None)()


def fits(d: DemoLength, limits) -> bool:
    # An expert turn ends with eos, so an episode of total <= max_total_tokens was never cut (rollout/loop.py).
    return (d.turns <= limits.max_turns and d.total_tokens <= limits.max_total_tokens
            and d.max_turn_tokens <= limits.max_new_tokens_per_turn)


def table(rows: dict[str, list[tuple[int, DemoLength]]]) -> str:
    head = ("| suite | seeds | demos | total tokens p50 / p99 / max | max_total_tokens | turns max | max_turns "
            "| longest turn | max_new_tokens_per_turn | dropped (worst seed) |")
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for name, items in rows.items():
        limits = episode_limits(build_config(overrides=[f"env={name}"]))
        totals = sorted(d.total_tokens for _, d in items)
        per_seed: dict[int, int] = {}
        for seed, d in items:
            per_seed[seed] = per_seed.get(seed, 0) + (not fits(d, limits))
        worst = max(per_seed.values())
        seeds = sorted(per_seed)
        named = f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2 \
            else ", ".join(map(str, seeds))
        lines.append(f"| {name} | {named} | {len(items)} | {statistics.median(totals):.0f} / "
                     f"{totals[int(0.99 * (len(totals) - 1))]} / {totals[-1]} | {limits.max_total_tokens} | "
                     f"{max(d.turns for _, d in items)} | {limits.max_turns} | "
                     f"{max(d.max_turn_tokens for _, d in items)} | {limits.max_new_tokens_per_turn} | "
                     f"{sum(per_seed.values())} ({worst} of {len(items) // len(per_seed)}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", nargs="+", default=list(SUITE_NAMES), choices=sorted(SUITES.names()))
    ap.add_argument("--seeds", default="0-19", help="inclusive range, e.g. 0-19")
    ap.add_argument("--demos", type=int, default=None, help="per seed (default: bc.num_demos)")
    ap.add_argument("--raw", type=Path, default=None, help="append per-demo lengths here (jsonl)")
    ap.add_argument("--from-raw", type=Path, default=None, help="only print the table from saved lengths")
    args = ap.parse_args()
    rows: dict[str, list[tuple[int, DemoLength]]] = {}
    if args.from_raw:
        for line in args.from_raw.read_text().splitlines():
            r = json.loads(line)
            rows.setdefault(r["suite"], []).append((r["seed"], DemoLength(*r["length"])))
        print(table(rows))
        return
    quiet_hf()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.suites:
            for seed in seed_list(args.seeds):
                t0 = time.perf_counter()
                lengths = measure(name, seed, args.demos, Path(tmp))
                rows.setdefault(name, []).extend((seed, d) for d in lengths)
                if args.raw:
                    with args.raw.open("a") as fh:
                        fh.writelines(json.dumps({"suite": name, "seed": seed, "length": list(vars(d).values())})
                                      + "\n" for d in lengths)
                print(f"{name} seed {seed}: max {max(d.total_tokens for d in lengths)} tokens, "
                      f"{max(d.turns for d in lengths)} turns ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
