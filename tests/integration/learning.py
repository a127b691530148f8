"""What the tests that assert learning share: the seed and thread count they run under, and how they judge a lift.

CI runs them on seed 0 with one thread; `python benchmarks/learning_tests.py` re-runs them (the `learning`
marker) under other seeds and both thread counts through AGENTGRAD_TEST_SEED and AGENTGRAD_TEST_THREADS.
A lift counts only when it clears the noise of the measurement that shows it: the held-out intervals of the
start and the end must not overlap (Wilson 95%, as the run prints them).
"""

from __future__ import annotations

import os

SEED = int(os.environ.get("AGENTGRAD_TEST_SEED", "0"))
THREADS = int(os.environ.get("AGENTGRAD_TEST_THREADS", "1"))
SWEEP = [f"run.seed={SEED}", f"run.threads={THREADS}"]


def assert_lift(name: str, start: dict, end: dict, *, min_points: float) -> None:
    """`start`/`end`: held-out evaluations as summary.json holds them (EvalResult.to_dict()). Prints one
    `learning:` line, which the sweep collects."""
    lift = end["success_rate"] - start["success_rate"]
    (s_lo, s_hi), (e_lo, e_hi) = start["ci95"], end["ci95"]
    print(f"learning: {name} (seed {SEED}, {THREADS} thread(s)): held-out {start['success_rate']:.1%} "
          f"[{s_lo:.1%}, {s_hi:.1%}] -> {end['success_rate']:.1%} [{e_lo:.1%}, {e_hi:.1%}], n={end['num_tasks']}")
    assert lift >= min_points, f"{name}: lift {lift:+.1%} is less than the {min_points:.0%} claimed"
    assert e_lo > s_hi, f"{name}: the 95% intervals overlap ([{s_lo:.1%}, {s_hi:.1%}] vs [{e_lo:.1%}, {e_hi:.1%}])"
