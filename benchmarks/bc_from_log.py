"""BC on an imported log of expert conversations vs BC on the suite's own expert, at the same budget.

    nice -n 19 .venv/bin/python benchmarks/bc_from_log.py [--episodes 10000] [--steps 120] [--seed 0]

1. `agentgrad data expert --episodes N` writes N expert episodes of the arithmetic suite (train split) as an
   OpenAI-format chat log with tool calls (the format `agentgrad data import` reads);
2. `agentgrad train algo.name=bc bc.demos=LOG` clones that log, re-imported through the importer's encoder with
   the run's own tokenizer;
3. `agentgrad train algo.name=bc` clones bc.num_demos episodes of the suite's expert;
both with bc.steps=STEPS and no early stop, then 200 greedy held-out tasks. Prints one row per run (success,
Wilson 95% interval, wall time). Not run in CI (two BC runs: ~10-30 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

AGENTGRAD = str(Path(sys.executable).parent / "agentgrad")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="bc-from-log-"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"arithmetic-expert-{args.episodes}.jsonl"
    # The stream BC's own expert draws from (run.seed + 1), so the log's first bc.num_demos episodes are its demos.
    subprocess.run([AGENTGRAD, "data", "expert", "--out", str(log), "--episodes", str(args.episodes),
                    "--seed", str(args.seed + 1)], check=True)
    budget = ["algo.name=bc", f"bc.steps={args.steps}", "bc.stop_at_success=null", f"run.seed={args.seed}",
              "run.progress=false", f"run.output_dir={out}"]
    runs = {"imported log": [f"bc.demos={log}"], "suite expert": []}
    procs = {}
    for name, extra in runs.items():  # side by side: each run is one thread, and a busy machine shares CPU per process
        run = f"{name.replace(' ', '-')}-s{args.seed}"
        with open(out / f"{run}.log", "w") as fh:
            procs[name] = (run, subprocess.Popen([AGENTGRAD, "train", *budget, *extra, f"run.name={run}"],
                                                 stdout=fh, stderr=subprocess.STDOUT))
    rows = []
    for name, (run, proc) in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"{name} run failed: see {out / (run + '.log')}")
        summary = json.loads((out / run / "summary.json").read_text())
        e = summary["final_eval"]
        rows.append((name, e["success_rate"], e["ci95"], e["num_tasks"], summary["wall_time_s"]))
    print(f"\n{'BC demos':<14} {'held-out':>9} {'95% CI':>15} {'n':>5} {'wall s':>8}")
    for name, rate, (lo, hi), n, wall in rows:
        print(f"{name:<14} {rate:>9.1%} {f'{lo:.1%}-{hi:.1%}':>15} {n:>5} {wall:>8.0f}")


if __name__ == "__main__":
    main()
