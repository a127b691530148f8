"""Scale-out generation on the default tiny model after a short BC warm-up (benchmarks/_common.py):

1. 64 concurrent episodes (16 tasks x 4 samples, one rollout as an RL step samples it) in process, and on Ray
   rollout workers (`rollout.backend=ray`, local runtime) with 1 and 2 workers; runs alternate, medians of
   `--repeats`; worker start-up (once per run) reported apart.
2. Async rollouts: `--rl-steps` GRPO steps from the same BC model with rollout.max_staleness=0 (synchronous) and 1,
   same seeds: median step time and held-out success (`--eval-tasks` tasks, greedy) after the steps.

    nice -n 19 python benchmarks/scale_out.py [--repeats 3] [--rl-steps 10] [--eval-tasks 100] [--skip-ray]

Ray is optional (pip install 'agentgrad[ray]'); without it part 1 has the in-process row only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternate, bc_model_dir, bench_config, median, table

from agentgrad.logging import ProgressDisplay, RunLogger
from agentgrad.pipelines import rl
from agentgrad.pipelines.components import build_components
from agentgrad.pipelines.train import held_out
from agentgrad.sinks import MemorySink

TASKS, GROUP = 16, 4


def rollout_rows(model_dir: Path, repeats: int, skip_ray: bool, work: Path) -> list[tuple[str, ...]]:
    base = [f"model.path={model_dir}", f"algo.tasks_per_step={TASKS}", f"algo.group_size={GROUP}"]
    local = build_components(bench_config(base), work / "local")
    backends = {"in process": local}
    startup: dict[str, float] = {}
    if not skip_ray and importlib.util.find_spec("ray") is not None:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        for n in (1, 2):
            # 3 workers in all on a 2-CPU runtime: each reserves half a CPU
            c = dataclasses.replace(local, config=bench_config([*base, "rollout.backend=ray", f"rollout.workers={n}",
                                                                "rollout.worker_cpus=0.5"]), rollout_runner=None)
            t0 = time.perf_counter()
            rl.rollout_groups(c, rl.rl_tasks(c, 0), 0)  # starts the workers and broadcasts the weights
            startup[f"ray, {n} worker{'s' * (n > 1)}"] = time.perf_counter() - t0
            backends[f"ray, {n} worker{'s' * (n > 1)}"] = c
    tokens: dict[str, int] = {}

    def measure(name: str):
        def run() -> float:
            c = backends[name]
            t0 = time.perf_counter()
            groups = rl.rollout_groups(c, rl.rl_tasks(c, 1), 1)
            tokens[name] = sum(s.trajectory.num_generated_tokens for g in groups for s in g.samples)
            return time.perf_counter() - t0
        return run

    times = alternate({name: measure(name) for name in backends}, repeats)
    rows = []
    for name, ts in times.items():
        rows.append((name, f"{median(ts):.2f}", f"{tokens[name] / median(ts):.0f}",
                     f"{startup[name]:.1f}" if name in startup else "-"))
    for c in backends.values():
        if c.rollout_runner is not None:
            c.rollout_runner.close()
    if startup:
        import ray

        ray.shutdown()
    return rows


def async_rows(model_dir: Path, steps: int, eval_tasks: int, work: Path) -> list[tuple[str, ...]]:
    rows = []
    for k in (0, 1):
        config = bench_config([f"model.path={model_dir}", f"algo.steps={steps}", f"rollout.max_staleness={k}",
                               f"eval.num_tasks={eval_tasks}"])
        c = build_components(config, work / f"async{k}")
        sink = MemorySink()
        t0 = time.perf_counter()
        rl.run_rl(c, RunLogger([sink], ProgressDisplay(enabled=False)))
        wall = time.perf_counter() - t0
        step_s = [r["perf/step_s"] for r in sink.metrics]
        result = held_out(c)
        rows.append((f"max_staleness={k}", f"{statistics.median(step_s[1:] or step_s):.2f}", f"{wall:.1f}",
                     f"{result.success_rate:.1%} ({result.ci_low:.0%}-{result.ci_high:.0%})"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rl-steps", type=int, default=10)
    parser.add_argument("--eval-tasks", type=int, default=100)
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--skip-async", action="store_true")
    args = parser.parse_args()
    model_dir = bc_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"{TASKS * GROUP} episodes (one rollout), median of {args.repeats}:")
        print(table(rollout_rows(model_dir, args.repeats, args.skip_ray, work),
                    ("backend", "rollout s", "tokens/s", "worker start-up s")))
        if not args.skip_async:
            print(f"\nGRPO, {args.rl_steps} steps from the BC model:")
            print(table(async_rows(model_dir, args.rl_steps, args.eval_tasks, work),
                        ("rollouts", "median step s", "wall s", "held-out success (95% CI)")))


if __name__ == "__main__":
    main()
