"""Re-run the tests that assert learning under other seeds and thread counts (by hand, not in CI).

    python benchmarks/learning_tests.py --seeds 0 1 2 --threads 1 2

CI runs each learning test once (seed 0, one thread). A result that holds for one seed on one CPU is not a
result, so this sweep sets AGENTGRAD_TEST_SEED and AGENTGRAD_TEST_THREADS (read by
tests/integration/learning.py) and runs the `learning`-marked tests for every combination, one pytest process
each, printing the lines the tests print (start -> end success) and a pass/fail table.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_one(seed: int, threads: int, k: str | None) -> tuple[int, int, bool, str, float]:
    env = {**os.environ, "AGENTGRAD_TEST_SEED": str(seed), "AGENTGRAD_TEST_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-rf", "-m", "learning", "-p", "no:cacheprovider",
           *(["-k", k] if k else []), "tests/integration"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    learned = [line[line.index("learning: "):].strip() for line in out.splitlines() if "learning: " in line]
    learned += [line.strip() for line in out.splitlines() if line.startswith("FAILED ")]  # which, and why
    summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
                   f"exit {proc.returncode}").strip("= ")
    print(f"--- seed {seed}, {threads} thread(s): {summary}\n" + "".join(f"    {x}\n" for x in learned), flush=True)
    return seed, threads, proc.returncode == 0, summary, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("-k", default=None, help="pytest -k expression (a subset of the learning tests)")
    ap.add_argument("--parallel", type=int, default=1, help="pytest processes at a time (one-thread combinations)")
    args = ap.parse_args(argv)
    combos = [(seed, threads) for threads in args.threads for seed in args.seeds]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        rows = list(pool.map(lambda st: run_one(*st, args.k), combos))
    print(f"\n{'seed':>4} {'thr':>3}  {'result':<40} {'wall s':>7}")
    for seed, threads, _ok, summary, wall in rows:
        print(f"{seed:>4} {threads:>3}  {summary:<40} {wall:>7.0f}")
    passed = sum(ok for _, _, ok, _, _ in rows)
    print(f"sweeps passing: {passed}/{len(rows)}")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
