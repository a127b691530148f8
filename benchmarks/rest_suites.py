"""ReST from a BC start, per suite and seed: held-out success at BC's stop and after ReST (by hand, not in CI).

    python benchmarks/rest_suites.py --suites arithmetic sql-qa --seeds 0 1 2 --out runs/bench-rest
    python benchmarks/rest_suites.py --suites code --seeds 0 1 2 --out runs/bench-rest-code3 \
        --set "env.options={kinds: [primes_below, collatz_steps, digit_sum_power]}"
    python benchmarks/rest_suites.py --table runs/bench-rest/results.jsonl

Each (suite, seed) trains BC once with the run's stop rule (a partial policy; cached in --out), evaluates it on
the held-out split, then runs the ReST stage alone from that checkpoint (`--rest` overrides, e.g.
`rest.improve_from=current` for Gulcehre et al.'s variant, `rest.tasks_per_iteration=64 rest.sft_steps=32` for the
Grow before 2026-12-06) and evaluates again on the same held-out tasks. The model
is the tests' fast shape (`FAST` of tests/integration/test_train_tiny.py); arithmetic uses FAST's products.
One line per run goes to results.jsonl; the table prints start, end, their Wilson 95% intervals and wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

SHAPE = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
         "model.tiny.intermediate_size=192", "model.tiny.tokenizer_corpus_episodes=100"]
PRODUCTS = ("env.options={min_operands: 2, max_operands: 2, min_digits: 2, max_digits: 2, operators: '*', "
            "result_digits: 4}")
BC = ["bc.steps=400", "bc.eval_tasks=48", "bc.num_demos=500", "bc.lr=3e-3", "bc.lr_scale_near_target=1.0",
      "bc.stop_at_success=0.3"]


# Extra overrides of both BC and ReST (--set), e.g. a suite's options; kept in each results row.
EXTRA: list[str] = []


def base_overrides(suite: str, seed: int) -> list[str]:
    env = [PRODUCTS] if suite == "arithmetic" else [f"env={suite}"]
    return [*env, *SHAPE, *BC, *EXTRA, "eval.num_tasks=200", "run.progress=false", "run.threads=1", f"run.seed={seed}",
            "run.name=bc"]


def bc_start(suite: str, seed: int, out: Path) -> tuple[Path, dict, float]:
    from agentgrad.config import build_config
    from agentgrad.pipelines.train import train

    root = out / f"{suite}-seed{seed}"
    done = root / "bc-start.json"
    if done.exists():
        saved = json.loads(done.read_text())
        return root / "bc" / "checkpoints" / "bc", saved["eval"], saved["wall_s"]
    t0 = time.perf_counter()
    summary = train(build_config(overrides=[*base_overrides(suite, seed), "algo=bc", f"run.output_dir={root}"]))
    wall = time.perf_counter() - t0
    done.write_text(json.dumps({"eval": summary["final_eval"], "wall_s": wall}))
    return root / "bc" / "checkpoints" / "bc", summary["final_eval"], wall


def run_rest(suite: str, seed: int, checkpoint: Path, rest: list[str], out: Path) -> tuple[dict, float, list[dict]]:
    from agentgrad.config import build_config
    from agentgrad.logging import ProgressDisplay, RunLogger
    from agentgrad.pipelines.components import build_components
    from agentgrad.pipelines.rest import REST_STAGE
    from agentgrad.pipelines.run_state import run_alone
    from agentgrad.pipelines.train import held_out

    class Sink:
        records: list[dict] = []

        def write(self, step, stage, metrics) -> None:
            self.records.append(dict(metrics))

        def close(self) -> None:
            pass

    config = build_config(overrides=[*base_overrides(suite, seed), "bc.steps=0", f"model.path={checkpoint}",
                                     "algo=rest", *rest])
    t0 = time.perf_counter()
    c = build_components(config, out / "scratch")
    sink = Sink()
    sink.records = []
    run_alone("rest", REST_STAGE, c, RunLogger([sink], ProgressDisplay(enabled=False)))
    end = held_out(c).to_dict()
    return end, time.perf_counter() - t0, sink.records


def fmt_eval(e: dict) -> str:
    lo, hi = e["ci95"]
    return f"{e['success_rate']:.1%} [{lo:.1%}, {hi:.1%}]"


def table(rows: list[dict]) -> str:
    lines = ["| suite | seed | variant (--rest overrides) | BC start | after ReST | lift | beyond noise | BC wall "
             "| ReST wall |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lift = r["end"]["success_rate"] - r["start"]["success_rate"]
        clear = "yes" if r["end"]["ci95"][0] > r["start"]["ci95"][1] else "no"
        variant = f"{r['label']} ({' '.join(r['rest']) or 'defaults'})"
        if r.get("set"):
            variant += f"; --set {' '.join(r['set'])}"
        lines.append(f"| {r['suite']} | {r['seed']} | {variant} | {fmt_eval(r['start'])} | {fmt_eval(r['end'])} "
                     f"| {lift * 100:+.1f} | {clear} | {r['bc_wall_s']:.0f} s | {r['rest_wall_s']:.0f} s |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", nargs="+", default=["arithmetic"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rest", nargs="*", default=[], help="rest.* overrides of the ReST run")
    ap.add_argument("--label", default="default", help="name of this variant in the table")
    ap.add_argument("--set", nargs="*", default=[], help="overrides of BC and ReST both (use a separate --out: "
                    "BC starts are cached per suite and seed), e.g. env.options={kinds: [primes_below]}")
    ap.add_argument("--bc-only", action="store_true", help="only train (and cache) the BC starts")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-rest"))
    ap.add_argument("--table", type=Path, default=None, help="print the table of a results.jsonl and exit")
    args = ap.parse_args()
    if args.table is not None:
        print(table([json.loads(x) for x in args.table.read_text().splitlines() if x.strip()]))
        return 0
    EXTRA[:] = args.set
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for suite in args.suites:
        for seed in args.seeds:
            checkpoint, start, bc_wall = bc_start(suite, seed, args.out)
            print(f"{suite} seed {seed}: BC start {fmt_eval(start)} ({bc_wall:.0f} s)", flush=True)
            if args.bc_only:
                continue
            end, wall, records = run_rest(suite, seed, checkpoint, args.rest, args.out)
            row = {"suite": suite, "seed": seed, "label": args.label, "rest": args.rest, "set": args.set,
                   "start": start, "end": end, "bc_wall_s": bc_wall, "rest_wall_s": wall,
                   "rollout_success": [m.get("rollout/success_rate") for m in records]}
            with (args.out / "results.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{suite} seed {seed} {args.label}: {fmt_eval(start)} -> {fmt_eval(end)} ({wall:.0f} s); rollout "
                  f"success {' '.join(f'{x:.2f}' for x in row['rollout_success'])}", flush=True)
            rows.append(row)
    if rows:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
