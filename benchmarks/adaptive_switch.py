"""The adaptive stage's measured switch, over seeds: the run of tests/integration/test_adaptive_tiny.py (BC to a
policy below the band, then `adaptive`: GRPO with a critic warmed on its rollouts, PPO once the rolling sampled
success reaches adaptive.up_at). Per seed: BC's held-out success, the first window's rolling success, the step
of each switch with the rolling values it read, the critic's explained variance at the switch (on the switch
step's batch, before the critic was fitted on it) and over the GRPO steps before it, and the final held-out
success. Results are appended to DIR/results.jsonl as runs finish.

    nice -n 19 .venv/bin/python benchmarks/adaptive_switch.py [--seeds 0 1] [--out DIR] [override ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from test_adaptive_tiny import ADAPTIVE, adaptive_rows  # the measured run's settings
from test_train_tiny import FAST

from agentgrad.config import build_config
from agentgrad.pipelines.train import train


def run(seed: int, out: Path, overrides: list[str]) -> dict:
    config = build_config(overrides=[*FAST, *ADAPTIVE, f"run.seed={seed}", "run.threads=1",
                                     f"run.output_dir={out}", f"run.name=seed{seed}", *overrides])
    started = time.perf_counter()
    summary = train(config)
    steps, _ = adaptive_rows(out / f"seed{seed}")
    window = config.adaptive.window_steps
    switches = [s for s in summary["stage_switches"] if s["from_stage"] == s["to_stage"]]
    first_up = next((s["at_step"] for s in switches if s["to_algo"] == "ppo"), None)
    warmup_ev = [steps[s]["critic/explained_variance"] for s in range(1, (first_up or 0) + 1)
                 if steps[s].get("critic/explained_variance") is not None]
    return {"seed": seed, "bc_heldout": summary["initial_success_rate"],
            "first_window_success": sum(steps[s]["rollout/success_rate"] for s in range(1, window + 1)) / window,
            "switches": [{k: s[k] for k in ("algo", "to_algo", "at_step", "reason", "values")} for s in switches],
            "warmup_ev_mean": sum(warmup_ev) / len(warmup_ev) if warmup_ev else None,
            "warmup_ev_last5": warmup_ev[-5:], "final_heldout": summary["final_success_rate"],
            "steps": len(steps), "wall_s": round(time.perf_counter() - started, 1)}


def table(results: list[dict]) -> str:
    lines = ["| seed | BC held-out | first window success | switches (step: from -> to, rolling success) | "
             "EV at the up switch | mean EV over the GRPO steps | final held-out | wall |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        moves = "; ".join(f"{s['at_step']}: {s['algo']} -> {s['to_algo']}, {s['values']['rolling_success']:.3f}"
                          for s in r["switches"]) or "none"
        up = next((s for s in r["switches"] if s["to_algo"] == "ppo"), None)
        ev = f"{up['values']['critic/explained_variance']:+.3f}" if up else "-"
        mean_ev = f"{r['warmup_ev_mean']:+.3f}" if r["warmup_ev_mean"] is not None else "-"
        lines.append(f"| {r['seed']} | {r['bc_heldout']:.1%} | {r['first_window_success']:.3f} | {moves} | {ev} | "
                     f"{mean_ev} | {r['final_heldout']:.1%} | {r['wall_s']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-adaptive"))
    parser.add_argument("--table", type=Path, help="print the table of an earlier results.jsonl and exit")
    parser.add_argument("overrides", nargs="*", help="more config overrides (key=value)")
    args = parser.parse_args()
    if args.table:
        print(table([json.loads(line) for line in args.table.read_text().splitlines()]))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        results.append(run(seed, args.out, args.overrides))
        with (args.out / "results.jsonl").open("a") as fh:
            fh.write(json.dumps(results[-1]) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
